"""Usage records (router/state/usage.py), written by the scripts that admit and end requests,
on a manual clock against real Redis: served, cancelled, failed and dead requests and refusals
land in their tenant's, model's and hour's record; reads sum them by tenant, model, hour or day;
the records expire with the retention; a read too large is refused naming the field."""

from __future__ import annotations

import json

import pytest

from router.dispatch.response_events import end_data, error_data
from router.errors import InvalidRequestError, RateLimitError, RouterError
from router.messages import RequestState
from router.state import keys
from router.state.queues import TenantQueues
from router.state.scripts import Scripts
from router.state.tenants import Tenant
from router.state.usage import MAX_CELLS, UsageReader, render
from tests.router.factories import ManualClock, add_tenants, harness, make_request, run

TIMINGS = {"admitted_s": 100.0, "granted_s": 100.25, "arrived_s": 100.5, "finished_s": 102.0}


async def _serve(h, tenant: str, rid: str, model: str, prompt: int, output: int,
                 cached: int = 0, error: bool = False) -> None:
    await h.queues.admit(make_request(tenant, rid, prompt_tokens=prompt, max_tokens=output,
                                      model=model))
    (grant,) = (await h.queues.grant("d", 1)).grants
    final = (error_data(RouterError("boom"), prompt, output) if error
             else end_data("stop", prompt, output, cached, TIMINGS))
    await h.queues.complete(grant.lease, prompt, output, "stop", final)


def test_each_ending_lands_in_its_tenants_models_and_hours_record(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", rpm=3), Tenant(id="beta"))
            await _serve(h, "acme", "a1", "m1", 10, 5, cached=4)
            await _serve(h, "acme", "a2", "m1", 20, 7)
            await _serve(h, "acme", "a3", "m2", 30, 2, error=True)
            with pytest.raises(RateLimitError):
                await h.queues.admit(make_request("acme", "a4", model="m1"))
            await h.queues.admit(make_request("beta", "b1", model="m1"))
            await h.queues.cancel("beta", "b1")  # cancelled while queued
            clock.advance(3_600_000)  # the next hour
            await _serve(h, "beta", "b2", "m1", 8, 3)
            reader = UsageReader(h.client)
            since, until = clock.now_ms - 2 * 3_600_000, clock.now_ms + 1
            rows = await reader.read(since, until)
            got = {(r.tenant, r.model, r.start_ms): r.counts for r in rows}
            hour = (clock.now_ms - 3_600_000) // keys.HOUR_MS * keys.HOUR_MS
            assert got[("acme", "m1", hour)] == {
                "requests": 2, "prompt_tokens": 30, "completion_tokens": 12, "cached_tokens": 4,
                "queue_ms": 500, "engine_ms": 3000, "refused_rpm": 1}
            assert got[("acme", "m2", hour)] == {
                "requests": 1, "prompt_tokens": 30, "completion_tokens": 2, "failed": 1}
            assert got[("beta", "m1", hour)] == {"requests": 1, "cancelled": 1}
            assert got[("beta", "m1", hour + keys.HOUR_MS)]["completion_tokens"] == 3
            by_tenant = {r.tenant: r for r in await reader.read(since, until, group_by=["tenant"])}
            assert by_tenant["acme"].counts["requests"] == 3 and by_tenant["acme"].refused == 1
            assert by_tenant["beta"].counts["requests"] == 2
            (day,) = await reader.read(since, until, tenants=["beta"], group_by=["day"])
            assert day.start_ms == hour // 86_400_000 * 86_400_000  # noon and 13:00: one day
            assert day.counts == {"requests": 2, "cancelled": 1, "prompt_tokens": 8,
                                  "completion_tokens": 3, "queue_ms": 250, "engine_ms": 1500}
            as_json = json.loads(render(rows, ["tenant", "model", "hour"], "json"))
            assert {"tenant", "model", "start", "requests", "refused"} <= set(as_json[0])
            assert render(rows, ["tenant", "model", "hour"], "csv").splitlines()[0].startswith(
                "tenant,model,start,requests")
            ttl = await h.client.ttl(keys.usage("acme", hour // keys.HOUR_MS))
            assert 34 * 86_400 < ttl <= 35 * 86_400

    run(scenario())


def test_a_dead_request_is_recorded_and_retention_zero_writes_nothing(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "d1", model="m1"))
            for _ in range(3):  # max_deliveries: the third lapse dead-letters it
                await h.queues.grant("d", 1)
                clock.advance(31_000)
                await h.queues.reap()
            assert (await h.queues.get("acme", "d1")).state is RequestState.DEAD
            (row,) = await UsageReader(h.client).read(clock.now_ms - 3_600_000,
                                                      clock.now_ms + 1)
            assert row.counts == {"requests": 1, "dead": 1}

            off = TenantQueues(Scripts(h.client, clock, usage_retention_days=0))
            await off.admit(make_request("acme", "x1", model="m1"))
            await off.cancel("acme", "x1")
            (row,) = await UsageReader(h.client).read(clock.now_ms - 3_600_000,
                                                      clock.now_ms + 1)
            assert row.counts == {"requests": 1, "dead": 1}  # unchanged

    run(scenario())


def test_bad_reads_are_refused_naming_the_field(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            reader = UsageReader(h.client)
            for kwargs, param in (({"group_by": ["week"]}, "group_by"),
                                  ({"group_by": ["hour", "day"]}, "group_by"),
                                  ({"until_ms": 0}, "until"),
                                  ({"tenants": [f"t{i}" for i in range(200)],
                                    "since_ms": 0, "until_ms": 3_600_000 * (MAX_CELLS // 100)},
                                   "since")):
                args = {"since_ms": 3_600_000, "until_ms": 7_200_000, **kwargs}
                with pytest.raises(InvalidRequestError) as err:
                    await reader.read(**args)
                assert err.value.param == param

    run(scenario())
