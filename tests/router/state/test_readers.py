"""Readers (router/state/readers.py): every client waiting on a request holds a lease in Redis.
A tenant's open streams and resumes are capped over all routers (429 with Retry-After beyond,
nothing admitted for a refused stream), a reader's end gives its place back, and the readers of
a router that stopped renewing (a crash) are let go when their leases run out: the tenant's count
comes down and the request is detached, so it is cancelled after its grace period."""

from __future__ import annotations

import time

import pytest

from router.errors import RateLimitError
from router.messages import Reader, ReaderKind, RequestState
from router.state import keys
from router.state.readers import ReaderLeases, lease_end_ms
from router.state.tenants import Tenant
from tests.router.factories import ManualClock, add_tenants, harness, make_request, run

LEASE_MS = keys.READER_LEASE_S * 1000
GRACE_MS = 5_000


def stream_reader(leases: ReaderLeases, tenant_id: str, request_id: str) -> Reader:
    return leases.new(tenant_id, request_id, ReaderKind.STREAM)


async def open_counts(h, tenant_id: str) -> tuple[int, int]:
    fields = await h.client.hmget(keys.state(tenant_id), "open_stream", "open_resume")
    return tuple(int(f or 0) for f in fields)  # type: ignore[return-value]


def test_open_streams_and_resumes_are_capped_per_tenant(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url, ManualClock(int(time.time() * 1000))) as h:
            await add_tenants(h, Tenant(id="acme", max_streams=2, max_resumes=1),
                          Tenant(id="beta", max_streams=2))
            leases = ReaderLeases(h.queues, GRACE_MS)
            readers = {}
            for rid in ("r1", "r2"):
                readers[rid] = stream_reader(leases, "acme", rid)
                await h.queues.admit(make_request("acme", rid, reader=readers[rid],
                                                  reader_lease_end_ms=lease_end_ms()))
                leases.admitted(readers[rid])
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "r3", reader=stream_reader(
                    leases, "acme", "r3"), reader_lease_end_ms=lease_end_ms()))
            assert err.value.status == 429 and err.value.reason == "streams"
            assert err.value.retry_after_s == keys.READER_RETRY_MS / 1000
            assert await h.queues.queued_ids("acme") == ["r1", "r2"]  # nothing of r3 admitted
            assert not await h.client.exists(keys.request("acme", "r3"))
            # another tenant is not counted against acme's cap
            await h.queues.admit(make_request("beta", "b1", reader=stream_reader(
                leases, "beta", "b1"), reader_lease_end_ms=lease_end_ms()))

            resume = leases.new("acme", "r1", ReaderKind.RESUME)
            await leases.attach(resume)
            with pytest.raises(RateLimitError) as err:
                await leases.attach(leases.new("acme", "r2", ReaderKind.RESUME))
            assert err.value.reason == "resumes"
            assert await open_counts(h, "acme") == (2, 1)

            # a reader's end gives its place back: the next stream is admitted
            await leases.detach(readers["r2"])
            await leases.detach(resume)
            assert await open_counts(h, "acme") == (1, 0)
            await h.queues.admit(make_request("acme", "r3", reader=stream_reader(
                leases, "acme", "r3"), reader_lease_end_ms=lease_end_ms()))
            assert await open_counts(h, "acme") == (2, 0)

    run(scenario())


def test_one_request_has_at_most_max_readers_per_request(redis_url) -> None:
    """Every token of a request is written to each of its readers: retries joining it and
    resumes of it are capped per request, so a tenant cannot multiply a router's work on one
    request by its whole max_streams (the hostile-tenant test's fan-out)."""
    async def scenario() -> None:
        async with harness(redis_url, ManualClock(int(time.time() * 1000))) as h:
            await add_tenants(h, Tenant(id="acme"))
            leases = ReaderLeases(h.queues, GRACE_MS)
            first = stream_reader(leases, "acme", "r1")
            await h.queues.admit(make_request("acme", "r1", reader=first,
                                              reader_lease_end_ms=lease_end_ms()))
            leases.admitted(first)
            joined = [stream_reader(leases, "acme", "r1")
                      for _ in range(keys.MAX_READERS_PER_REQUEST - 2)]
            for reader in joined:
                await leases.attach(reader)
            resume = leases.new("acme", "r1", ReaderKind.RESUME)
            await leases.attach(resume)  # the cap's last place
            for extra in (stream_reader(leases, "acme", "r1"),
                          leases.new("acme", "r1", ReaderKind.RESUME)):
                with pytest.raises(RateLimitError) as err:
                    await leases.attach(extra)
                assert err.value.status == 429 and err.value.reason == "readers"
                assert err.value.retry_after_s == keys.READER_RETRY_MS / 1000
            assert int(await h.client.hget(keys.request("acme", "r1"), "readers")) == (
                keys.MAX_READERS_PER_REQUEST)
            assert await open_counts(h, "acme") == (keys.MAX_READERS_PER_REQUEST - 1, 1)
            # a reader's end gives its place back
            await leases.detach(joined[0])
            await leases.attach(stream_reader(leases, "acme", "r1"))

    run(scenario())


def test_a_dead_routers_readers_are_let_go_and_their_requests_detached(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock(int(time.time() * 1000))
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", max_streams=1))
            alive, dead = ReaderLeases(h.queues, GRACE_MS), ReaderLeases(h.queues, GRACE_MS)
            kept = stream_reader(alive, "acme", "kept")
            await h.queues.admit(make_request("acme", "kept"))  # admitted without a reader
            await alive.attach(kept)
            await h.queues.grant("d", free_slots=10)  # running
            lost = stream_reader(dead, "acme", "lost")
            await h.client.hset(keys.tenant("acme"), "max_streams", 2)
            await h.queues.admit(make_request("acme", "lost", reader=lost,
                                              reader_lease_end_ms=lease_end_ms()))
            dead.admitted(lost)
            await h.queues.grant("d", free_slots=10)
            assert await open_counts(h, "acme") == (2, 0)

            clock.advance(LEASE_MS / 2)
            await alive.queues.renew_readers([kept.member], clock.now_ms + LEASE_MS)
            assert await h.queues.sweep_readers(GRACE_MS) == 0  # none ran out yet
            clock.advance(LEASE_MS / 2 + 5_000)  # the dead router never renewed
            assert await h.queues.sweep_readers(GRACE_MS) == 1
            assert await open_counts(h, "acme") == (1, 0)
            detached = await h.client.zrange(keys.detached(), 0, -1, withscores=True)
            assert detached == [(b"acme lost", clock.now_ms + GRACE_MS)]
            assert int(await h.client.hget(keys.request("acme", "lost"), "readers")) == 0
            # the dead router's own detach, should it come late, counts once
            assert await dead.queues.detach(lost, clock.now_ms) == -1
            assert await open_counts(h, "acme") == (1, 0)
            assert (await h.queues.get("acme", "kept")).state is RequestState.LEASED
            assert await h.client.zcard(keys.readers()) == 1

    run(scenario())
