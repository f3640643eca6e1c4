"""A router whose lease on a request lapsed may be granted the same request again (attempt
2) while its first attempt still runs: losing the first lease must stop only the first."""

from __future__ import annotations

import asyncio
import time

from router.dispatch.dispatcher import Dispatcher, DispatchSettings
from router.dispatch.relay import Running
from router.state.tenants import Tenant
from tests.router.factories import ManualClock, add_tenants, harness, make_request, run

HOLDER = "router-a"


def test_losing_an_old_lease_leaves_the_new_attempt_of_the_same_router_running(
        redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="t"))
            await h.queues.admit(make_request("t", "r1"))
            (first,) = (await h.queues.grant(HOLDER, 1)).grants
            clock.advance(h.queues.settings.lease_ms + 1)  # its renewals came too late
            assert (await h.queues.reap()).num_requeued == 1
            (second,) = (await h.queues.grant(HOLDER, 1)).grants
            assert (second.request_id, second.lease.attempt) == ("r1", 2)

            dispatcher = Dispatcher(h.queues, replicas=None, holder=HOLDER,  # type: ignore[arg-type]
                                    settings=DispatchSettings(renew_s=0.01))
            old, new = Running(first, time.monotonic_ns(), 0), Running(second, 0, 0)
            dispatcher._running["r1"] = new  # what _serve of attempt 2 registered
            await asyncio.wait_for(dispatcher._renew(old), 5)  # finds its lease gone
            assert old.is_lease_lost and not old.is_cancel_requested  # dropped, not cancelled
            assert not new.is_lease_lost and not new.is_cancel_requested, \
                "attempt 2 was stopped with attempt 1"
            assert dispatcher.abort_local("r1") and new.is_cancel_requested  # a hang-up: 2

    run(scenario())
