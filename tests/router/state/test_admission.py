"""Admission: idempotency, quotas (RPM, TPM, daily budget) with their retry-after, refunds,
queue caps, and clear errors for bad input."""

from __future__ import annotations

import pytest

from router.errors import (
    IdempotencyKeyReusedError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    StoredDataError,
)
from router.messages import RequestState
from router.state import keys
from router.state.tenants import Tenant
from tests.router.factories import ManualClock, add_tenants, harness, make_request, run

DAY_MS = 86_400_000


async def _grant_all(h, holder: str = "d") -> list:
    batch = await h.queues.grant(holder, free_slots=1000, max_grants=1000)
    return batch.grants


def test_repeat_id_returns_the_existing_request_never_a_second_copy(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            first = await h.queues.admit(make_request("acme", "r1"))
            again = await h.queues.admit(make_request("acme", "r1"))
            assert not first.is_duplicate and again.is_duplicate
            assert again.state == RequestState.QUEUED
            assert await h.queues.queued_ids("acme") == ["r1"]
            grants = await _grant_all(h)
            assert [g.request_id for g in grants] == ["r1"]
            # after the grant a repeat still returns the one request, now leased
            assert (await h.queues.admit(make_request("acme", "r1"))).state == RequestState.LEASED
            assert await h.queues.depth("acme") == 0
            # the same id in another tenant is another request: ids are per tenant
            await add_tenants(h, Tenant(id="beta"))
            assert not (await h.queues.admit(make_request("beta", "r1"))).is_duplicate

    run(scenario())


def test_reused_id_with_another_body_is_422_as_the_idempotency_draft_says(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r1", max_tokens=20))
            with pytest.raises(IdempotencyKeyReusedError) as err:
                await h.queues.admit(make_request("acme", "r1", max_tokens=30))
            assert err.value.status == 422 and err.value.param == "Idempotency-Key"
            assert await h.queues.depth("acme") == 1

    run(scenario())


def test_rpm_refuses_with_the_gcra_retry_after(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", rpm=6))  # one every 10 s, burst of 6
            for i in range(6):
                await h.queues.admit(make_request("acme", f"r{i}"))
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "r6"))
            assert err.value.reason == "rpm" and err.value.status == 429
            assert err.value.retry_after_s == pytest.approx(10.0)
            clock.advance(4_000)
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "r6"))
            assert err.value.retry_after_s == pytest.approx(6.0)
            clock.advance(6_000)  # exactly when it said
            await h.queues.admit(make_request("acme", "r6"))
            with pytest.raises(RateLimitError):
                await h.queues.admit(make_request("acme", "r7"))
            # a refused request is not stored: its id is free to use later
            with pytest.raises(NotFoundError):
                await h.queues.get("acme", "r7")

    run(scenario())


def test_tpm_refuses_with_retry_after_and_refunds_unused_tokens(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", tpm=600))  # 10 tokens a second
            await h.queues.admit(make_request("acme", "a", prompt_tokens=100, max_tokens=400))
            await h.queues.admit(make_request("acme", "b", prompt_tokens=50, max_tokens=50))
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "c", prompt_tokens=50, max_tokens=50))
            assert err.value.reason == "tpm"
            # 600 reserved of 600: 100 more fit after 100 / 10 tokens per s = 10 s
            assert err.value.retry_after_s == pytest.approx(10.0)
            grants = await _grant_all(h)
            # "a" used 100 + 40 of its 500: 360 come back, so "c" (100) fits at once
            refund = await h.queues.complete(grants[0].lease, 100, 40, "stop")
            assert refund == 360
            await h.queues.admit(make_request("acme", "c", prompt_tokens=50, max_tokens=50))

    run(scenario())


def test_request_larger_than_a_limit_is_413_not_retry(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", tpm=1000, daily_tokens=5000),
                              Tenant(id="beta", daily_tokens=500))
            with pytest.raises(RequestTooLargeError) as err:
                await h.queues.admit(make_request("acme", "r", prompt_tokens=900, max_tokens=200))
            assert err.value.status == 413 and "tpm" in err.value.message
            with pytest.raises(RequestTooLargeError) as err:
                await h.queues.admit(make_request("beta", "r", prompt_tokens=400, max_tokens=200))
            assert "daily_budget" in err.value.message
            assert await h.queues.depth("acme") == await h.queues.depth("beta") == 0

    run(scenario())


def test_daily_budget_refuses_until_midnight_and_refunds_restore_it_exactly(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", daily_tokens=1000))
            day = clock.now_ms // DAY_MS
            await h.queues.admit(make_request("acme", "a", prompt_tokens=300, max_tokens=300))
            await h.queues.admit(make_request("acme", "b", prompt_tokens=200, max_tokens=200))
            budget_key = keys.budget("acme", day)
            assert int(await h.client.get(budget_key)) == 1000
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "c", prompt_tokens=1, max_tokens=1))
            assert err.value.reason == "daily_budget"
            midnight = (day + 1) * DAY_MS
            assert err.value.retry_after_s == pytest.approx((midnight - clock.now_ms) / 1000)
            grants = {g.request_id: g for g in await _grant_all(h)}
            assert await h.queues.complete(grants["a"].lease, 300, 7, "stop") == 293
            assert int(await h.client.get(budget_key)) == 1000 - 293
            # cancelled while running: charged what it used, the rest refunded
            assert await h.queues.complete(grants["b"].lease, 200, 0, "abort",
                                           outcome=RequestState.CANCELLED) == 200
            assert int(await h.client.get(budget_key)) == 307 + 200
            assert (await h.queues.get("acme", "b")).state == RequestState.CANCELLED
            # a queued cancel refunds the whole reservation
            await h.queues.admit(make_request("acme", "d", prompt_tokens=100, max_tokens=100))
            assert int(await h.client.get(budget_key)) == 707
            await h.queues.cancel("acme", "d")
            assert int(await h.client.get(budget_key)) == 507
            # the next UTC day starts a fresh budget
            await h.queues.admit(make_request("acme", "e", prompt_tokens=400, max_tokens=90))
            with pytest.raises(RateLimitError):
                await h.queues.admit(make_request("acme", "f", prompt_tokens=10, max_tokens=10))
            clock.now_ms = midnight
            await h.queues.admit(make_request("acme", "f", prompt_tokens=10, max_tokens=10))
            assert await h.client.ttl(keys.budget("acme", day + 1)) > 0

    run(scenario())


def test_queue_cap_refuses_with_retry_after(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", max_queued=2))
            await h.queues.admit(make_request("acme", "a"))
            await h.queues.admit(make_request("acme", "b"))
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "c"))
            assert err.value.reason == "queue_full"
            assert err.value.retry_after_s == pytest.approx(1.0)
            await _grant_all(h)  # running requests do not count against the queue cap
            await h.queues.admit(make_request("acme", "c"))

    run(scenario())


def test_max_tokens_over_the_cap_is_400_naming_the_field(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", max_tokens=256))
            with pytest.raises(InvalidRequestError) as err:
                await h.queues.admit(make_request("acme", "r", max_tokens=257))
            assert err.value.param == "max_tokens" and "256" in err.value.message

    run(scenario())


@pytest.mark.parametrize(
    ("field", "request_kwargs"),
    [
        ("tenant", {"tenant_id": "Bad{Tag}"}),
        ("request_id", {"request_id": "x y"}),
        ("request_id", {"request_id": ""}),
        ("prompt_tokens", {"prompt_tokens": -1}),
        ("max_tokens", {"max_tokens": 0}),
    ],
)
def test_bad_input_names_the_field(redis_url, field: str, request_kwargs: dict) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            args = {"tenant_id": "acme", "request_id": "r", **request_kwargs}
            with pytest.raises(InvalidRequestError) as err:
                await h.queues.admit(make_request(args.pop("tenant_id"), args.pop("request_id"),
                                                  **args))
            assert err.value.param == field and err.value.status == 400

    run(scenario())


def test_unknown_and_disabled_tenants_are_refused(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="off", disabled=True))
            with pytest.raises(NotFoundError) as err:
                await h.queues.admit(make_request("nobody", "r"))
            assert err.value.param == "tenant" and "nobody" in err.value.message
            with pytest.raises(PermissionDeniedError):
                await h.queues.admit(make_request("off", "r"))
            assert await h.client.exists(keys.request("nobody", "r"), keys.request("off", "r")) == 0

    run(scenario())


def test_malformed_limiter_state_is_a_clear_error_and_writes_nothing(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", rpm=10))
            await h.client.hset(keys.state("acme"), "rpm_tat", "garbage")
            with pytest.raises(StoredDataError) as err:
                await h.queues.admit(make_request("acme", "r"))
            assert keys.state("acme") in err.value.message and "rpm_tat" in err.value.message
            assert await h.queues.depth("acme") == 0

    run(scenario())


def test_n_choices_reserve_and_cost_the_output_n_times_the_prompt_once(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", tpm=1000, max_tokens=100))
            await h.queues.admit(make_request("acme", "n3", prompt_tokens=40, max_tokens=100,
                                              num_choices=3))
            record = await h.queues.get("acme", "n3")
            assert record.reserved_tokens == 40 + 3 * 100
            backlog = {b.tenant_id: b for b in await h.queues.backlog()}
            assert backlog["acme"].queued_tokens == 40 + 3 * 100
            # the tenant's max_tokens cap is per choice; TPM sees all the choices
            with pytest.raises(RequestTooLargeError, match="tpm"):
                await h.queues.admit(make_request("acme", "n10", prompt_tokens=40,
                                                  max_tokens=100, num_choices=10))
            grants = await _grant_all(h)
            refund = await h.queues.complete(grants[0].lease, 40, 3 * 60, "stop")
            assert refund == 3 * 40

    run(scenario())


def test_an_ended_request_keeps_one_window_then_only_its_key_digest(redis_url) -> None:
    """The record and the stream of an ended request expire together, after the resume window
    (settable); past it an Idempotency-Key's retry is a 409 that runs nothing, for 24 h, kept
    by a digest of ~0.1 KB, and a request without a key leaves nothing at all."""
    from router.errors import IdempotencyKeyExpiredError
    from router.state.scripts import Scripts
    from tests.router.factories import Harness

    async def scenario() -> None:
        async with harness(redis_url) as base:
            h = Harness(base.client, Scripts(base.client, resume_window_s=120), base.tenants,
                        base.api_keys, base.queues, base.streams)
            h.queues.scripts = h.scripts
            await add_tenants(h, Tenant(id="acme"))
            keyed = make_request("acme", "chatcmpl-idem-1", is_idempotent=True)
            await h.queues.admit(keyed)
            await h.queues.admit(make_request("acme", "plain"))
            for grant in (await h.queues.grant("d", 2)).grants:
                await h.queues.complete(grant.lease, 10, 3, "stop", "{}")
            for rid in ("chatcmpl-idem-1", "plain"):
                record_ttl = await h.client.ttl(keys.request("acme", rid))
                stream_ttl = await h.client.ttl(keys.stream("acme", rid))
                assert 110 < record_ttl <= 120 and abs(record_ttl - stream_ttl) <= 1, rid
            digest = keys.idempotency("acme", "chatcmpl-idem-1")
            assert 86_000 < await h.client.ttl(digest) <= keys.IDEMPOTENCY_TTL_S
            assert not await h.client.exists(keys.idempotency("acme", "plain"))
            # within the window a retry joins the ended request
            assert (await h.queues.admit(keyed)).state == RequestState.COMPLETED
            # the window ends: what expires with it is gone
            await h.client.delete(*[k(t, r) for k in (keys.request, keys.stream)
                                    for t, r in (("acme", "chatcmpl-idem-1"), ("acme", "plain"))])
            left = sorted(k.decode() for k in await h.client.keys("*idem-1*"))
            assert left == [digest]
            assert await h.client.memory_usage(digest) <= 200
            assert not await h.client.keys("*plain*")
            with pytest.raises(IdempotencyKeyExpiredError) as err:
                await h.queues.admit(keyed)
            assert err.value.status == 409 and err.value.param == "Idempotency-Key"
            with pytest.raises(IdempotencyKeyReusedError):
                await h.queues.admit(make_request("acme", "chatcmpl-idem-1", max_tokens=7,
                                                  is_idempotent=True))
            assert await h.queues.depth("acme") == 0  # nothing ran again

    run(scenario())


def test_a_full_store_refuses_with_a_503_and_recovers_by_itself(redis_url) -> None:
    """Redis at its maxmemory (noeviction): an admission is refused whole with a 503
    ``store_full`` and a Retry-After, nothing half-written; what was admitted stays; once memory
    is there again (records expire, or more is given) admissions go on."""
    from router.errors import StoreFullError

    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", max_queued=100_000))
            await h.queues.admit(make_request("acme", "before"))
            used = (await h.client.info("memory"))["used_memory"]
            await h.client.config_set("maxmemory-policy", "noeviction")
            await h.client.config_set("maxmemory", used + 300_000)
            admitted = ["before"]
            try:
                with pytest.raises(StoreFullError) as err:
                    for i in range(100_000):
                        await h.queues.admit(make_request("acme", f"r{i}"))
                        admitted.append(f"r{i}")
                assert err.value.status == 503 and err.value.code == "store_full"
                assert err.value.retry_after_s >= 1
                refused = f"r{len(admitted) - 1}"
                assert not await h.client.exists(keys.request("acme", refused))
                assert await h.queues.queued_ids("acme") == admitted  # all kept, none half
            finally:
                await h.client.config_set("maxmemory", 0)
            await h.queues.admit(make_request("acme", "after"))
            assert (await h.queues.queued_ids("acme"))[-1] == "after"

    run(scenario())
