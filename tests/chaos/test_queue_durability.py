"""kill -9 of redis-server with appendfsync always: every admitted request is still there after
a restart on the same data directory, in order, with its lease."""

from __future__ import annotations

import pytest

from cluster.benchmarks.durability import crash_trial
from cluster.redis_server import AppendFsync, EmbeddedRedis
from router.messages import RequestState
from router.state import keys
from router.state.tenants import Tenant
from tests.router.factories import harness, make_request, run

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def test_no_acknowledged_admission_is_lost_when_killed_mid_stream(tmp_path) -> None:
    trial = crash_trial(tmp_path, AppendFsync.ALWAYS, kill_after_s=0.8)
    assert trial.num_acknowledged > 50  # the kill really landed mid-stream
    assert trial.num_lost == 0
    assert trial.is_order_kept


async def _snapshot(h) -> dict:
    snapshot: dict = {"leases": await h.client.zrange(keys.leases(), 0, -1, withscores=True)}
    for tenant_id in ("a", "b", "c"):
        snapshot[tenant_id] = await h.queues.queued_ids(tenant_id)
        for rid in snapshot[tenant_id]:
            snapshot[(tenant_id, rid)] = await h.queues.get(tenant_id, rid)
    for score_member in snapshot["leases"]:
        tenant_id, rid = score_member[0].decode().split(" ")
        snapshot[(tenant_id, rid)] = await h.queues.get(tenant_id, rid)
    return snapshot


def test_queued_and_leased_requests_survive_kill_9_in_order_with_their_leases(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path, appendfsync=AppendFsync.ALWAYS).start()

    async def before() -> tuple[dict, list]:
        async with harness(server.url) as h:
            for tenant_id, weight in (("a", 1), ("b", 2), ("c", 3)):
                await h.tenants.add(Tenant(id=tenant_id, weight=weight))
            for i in range(60):
                await h.queues.admit(make_request("abc"[i % 3], f"r{i}"))
            grants = (await h.queues.grant("d1", 20)).grants
            for g in grants[:5]:
                await h.queues.complete(g.lease, 10, 5, "stop")
            return await _snapshot(h), grants[5:]

    snapshot, held = run(before())
    assert sum(len(snapshot[t]) for t in "abc") == 40 and len(snapshot["leases"]) == 15
    server.kill()
    restarted = EmbeddedRedis(tmp_path, port=server.port, appendfsync=AppendFsync.ALWAYS).start()

    async def after() -> None:
        async with harness(restarted.url) as h:
            assert await _snapshot(h) == snapshot
            # the leases are live: their holder completes them; the queue goes on in order
            for g in held:
                assert (await h.queues.get(g.tenant_id, g.request_id)).state == RequestState.LEASED
                await h.queues.complete(g.lease, 10, 5, "stop")
            granted = (await h.queues.grant("d2", 100, max_grants=100)).grants
            for tenant_id in "abc":
                assert [g.request_id for g in granted if g.tenant_id == tenant_id] == \
                    snapshot[tenant_id]

    try:
        run(after())
    finally:
        restarted.stop()
