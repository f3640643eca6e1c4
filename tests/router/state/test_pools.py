"""Pools: each model's own queues (router/state/scripts/_lib.lua). One model's flood neither
delays nor takes the capacity of another's requests; fair share, queue limits, leases and the
backlog are per pool, and a request stays in its pool through lease expiry and cancel."""

from __future__ import annotations

import time

import pytest

from replicas.protocol import ReplicaLoad
from router.errors import InvalidRequestError, RateLimitError
from router.state import keys
from router.state.capacity import CapacityView
from router.state.tenants import Tenant
from tests.router.factories import ManualClock, add_tenants, harness, make_request, run

BIG = "big-model"


def test_a_flood_on_one_model_does_not_delay_or_take_the_capacity_of_another(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="flood", max_queued=500), Tenant(id="quiet"))
            for i in range(200):
                await h.queues.admit(make_request("flood", f"f{i}", pool=BIG))
            await h.queues.admit(make_request("quiet", "q0"))
            # the big model's replicas are full (capacity 4, 4 leased): none of it counts here
            big = await h.queues.grant("d1", free_slots=4, capacity=4, pool=BIG)
            assert [g.tenant_id for g in big.grants] == ["flood"] * 4
            assert not (await h.queues.grant("d1", free_slots=4, capacity=4, pool=BIG)).grants
            (quiet,) = (await h.queues.grant("d1", free_slots=8, capacity=4)).grants
            assert (quiet.tenant_id, quiet.request_id) == ("quiet", "q0")
            assert not (await h.queues.grant("d1", free_slots=8)).grants  # none of the flood
            assert await h.queues.depth("flood", BIG) == 196 and await h.queues.depth("flood") == 0
            assert await h.queues.num_leased(BIG) == 4 and await h.queues.num_leased() == 1

            rows = {(b.tenant_id, b.pool): b for b in await h.queues.backlog(by_pool=True)}
            assert (rows["flood", BIG].num_queued, rows["flood", BIG].num_leased) == (196, 4)
            assert (rows["flood", BIG].queued_tokens) == 196 * 30
            assert rows["quiet", ""].num_leased == 1 and ("quiet", BIG) not in rows
            total = {b.tenant_id: b for b in await h.queues.backlog()}
            assert (total["flood"].num_queued, total["flood"].num_leased) == (196, 4)

    run(scenario())


def test_fair_share_is_kept_per_model(redis_url) -> None:
    """A tenant that used the default model a lot is not behind on another model: its finish
    tags are per pool. In the pool both tenants use, they alternate (equal weights)."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="a"), Tenant(id="b"))
            for i in range(20):
                await h.queues.admit(make_request("a", f"a-default-{i}"))
            for _ in range(2):  # a has used the default model alone: far ahead on its clock
                batch = await h.queues.grant("d1", free_slots=10)
                for g in batch.grants:
                    await h.queues.complete(g.lease, g.prompt_tokens, g.max_tokens, "length")
            default_tag = await h.client.hget(keys.state("a"), "vfinish")
            for i in range(4):
                await h.queues.admit(make_request("b", f"b{i}", pool=BIG))
                await h.queues.admit(make_request("a", f"a{i}", pool=BIG))
            granted = [g.tenant_id for g in
                       (await h.queues.grant("d1", free_slots=8, pool=BIG)).grants]
            assert granted.count("a") == 4 and granted[:2] in (["a", "b"], ["b", "a"])
            assert granted[:4].count("a") == 2, granted  # no debt carried over from the default
            # the tags of each pool are its own: the big model's grants moved only its tag
            assert await h.client.hget(keys.state("a"), "vfinish") == default_tag
            assert float(await h.client.hget(keys.state("a"), f"vfinish:{BIG}")) < float(
                default_tag)

    run(scenario())


def test_queue_limits_leases_and_cancels_stay_in_their_pool(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="t", max_queued=2))
            for pool in ("", BIG):  # max_queued: per model
                for i in range(2):
                    await h.queues.admit(make_request("t", f"r{pool}{i}", pool=pool))
                with pytest.raises(RateLimitError):
                    await h.queues.admit(make_request("t", f"over{pool}", pool=pool))
            assert await h.client.smembers(keys.pools()) == {BIG.encode()}

            (leased,) = (await h.queues.grant("d1", free_slots=1, pool=BIG)).grants
            clock.advance(h.queues.settings.lease_ms + 1)
            assert (await h.queues.reap()).num_requeued == 1  # found in its pool's leases
            assert await h.queues.queued_ids("t", BIG) == [leased.request_id, f"r{BIG}1"]
            assert await h.queues.queued_ids("t") == ["r0", "r1"]

            await h.queues.cancel("t", f"r{BIG}1")
            assert await h.queues.queued_ids("t", BIG) == [leased.request_id]
            (again,) = (await h.queues.grant("d1", free_slots=4, pool=BIG)).grants
            assert (again.request_id, again.lease.attempt) == (leased.request_id, 2)
            await h.queues.renew(again.lease)
            assert await h.client.zscore(keys.leases(BIG), f"t {again.request_id}")
            await h.queues.complete(again.lease, 10, 20, "length")
            await h.queues.reap()  # the pool is empty now: forgotten
            assert await h.client.smembers(keys.pools()) == set()
            assert not await h.client.exists(keys.classes(BIG), keys.leases(BIG))

    run(scenario())


def test_a_priority_change_moves_the_tenant_in_every_pool(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="t"), Tenant(id="other"))
            await h.queues.admit(make_request("t", "x", pool=BIG))
            await h.queues.admit(make_request("other", "y", pool=BIG))
            assert await h.client.zscore(keys.ready(0, BIG), "t") is not None
            await h.tenants.update("t", priority=2)
            assert await h.client.zscore(keys.ready(0, BIG), "t") is None
            assert await h.client.zscore(keys.ready(2, BIG), "t") is not None
            (first, _) = (await h.queues.grant("d1", free_slots=2, pool=BIG)).grants
            assert first.tenant_id == "t"  # its new class first

    run(scenario())


def test_a_pool_name_that_could_break_out_of_its_key_is_refused() -> None:
    for bad in ("a:b", "a b", "", "-x", "x" * 65):
        if bad:
            with pytest.raises(InvalidRequestError):
                keys.queue("t", bad)
    assert keys.queue("t", "") == "fs:{t}:queue"
    assert keys.queue("t", "Qwen2.5-0.5B") == "fs:{t}:queue:Qwen2.5-0.5B"


def test_each_model_counts_its_own_replicas_slots(redis_url) -> None:
    """A dispatcher grants against its model's replicas only; a report naming no model (a
    replica of an older version, mid-upgrade) counts for the default model."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            now_ms = int(time.time() * 1000)
            for replica_id, model, slots in (("a", "base", 4), ("b", "", 2), ("c", BIG, 8)):
                load = ReplicaLoad(replica_id, slots, 0, 0, 0, 10, 10, 0.0, now_ms, model=model)
                await h.client.set(keys.replica(replica_id), load.to_json())
                await h.client.zadd(keys.replicas(), {replica_id: now_ms})
            assert await CapacityView(h.client, model="base").total_slots() == 6
            assert await CapacityView(h.client, model=BIG, is_default=False).total_slots() == 8
            assert await CapacityView(h.client).total_slots() == 14

    run(scenario())
