"""OpenAI's rate-limit headers (router/state/rate_limits.py) from the limiters the admission
script enforces, on a manual clock against real Redis: they move with each admission, a refusal
carries them, half the window gives half back, the whole window all; the day's budget resets at
midnight UTC; a tenant without limits gets none."""

from __future__ import annotations

import pytest

from router.errors import RateLimitError
from router.state.rate_limits import DAY_MS, RateLimits, duration
from router.state.tenants import Tenant
from tests.router.factories import ManualClock, add_tenants, harness, make_request, run


def test_durations_are_written_as_openai_writes_them() -> None:
    assert [duration(ms) for ms in (0, 16.2, 999, 1000, 1500, 60_000, 360_000, 3_723_000)] == [
        "0s", "17ms", "999ms", "1s", "1.5s", "1m0s", "6m0s", "1h2m3s"]


def test_the_headers_move_with_each_admission_and_come_back_with_the_window(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", rpm=6, tpm=600, daily_tokens=10_000))
            heads = []
            for i in range(3):  # 10 + 20 tokens each
                admission = await h.queues.admit(make_request("acme", f"r{i}"))
                heads.append(admission.rate_limit_headers)
            assert [x["x-ratelimit-remaining-requests"] for x in heads] == ["5", "4", "3"]
            assert [x["x-ratelimit-remaining-tokens"] for x in heads] == ["570", "540", "510"]
            assert [x["x-ratelimit-remaining-tokens-day"] for x in heads] == [
                "9970", "9940", "9910"]
            last = heads[-1]
            assert (last["x-ratelimit-limit-requests"], last["x-ratelimit-limit-tokens"],
                    last["x-ratelimit-limit-tokens-day"]) == ("6", "600", "10000")
            # 3 of 6 requests spoken for: whole again after 3 x 10 s; 90 tokens at 10 a second
            assert last["x-ratelimit-reset-requests"] == "30s"
            assert last["x-ratelimit-reset-tokens"] == "9s"
            midnight = (clock.now_ms // DAY_MS + 1) * DAY_MS
            assert last["x-ratelimit-reset-tokens-day"] == duration(midnight - clock.now_ms)

            clock.advance(15_000)  # half the requests' window: half of what was spoken for
            heads = (await h.queues.admit(make_request("acme", "r3"))).rate_limit_headers
            # 30 s behind - 15 s + 10 s for this one = 25 s: 3.5 of 6 free, 3 whole
            assert heads["x-ratelimit-remaining-requests"] == "3"
            assert heads["x-ratelimit-reset-requests"] == "25s"
            assert heads["x-ratelimit-remaining-tokens"] == "570"  # the earlier 90 came back
            assert heads["x-ratelimit-remaining-tokens-day"] == "9880"  # the day does not

            clock.advance(60_000)  # a whole window: everything back but the day
            heads = (await h.queues.admit(make_request("acme", "r4"))).rate_limit_headers
            assert heads["x-ratelimit-remaining-requests"] == "5"
            assert heads["x-ratelimit-remaining-tokens"] == "570"

    run(scenario())


def test_a_refusal_carries_the_headers_and_a_tenant_without_limits_gets_none(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock) as h:
            await add_tenants(h, Tenant(id="acme", rpm=2), Tenant(id="free"))
            for i in range(2):
                await h.queues.admit(make_request("acme", f"r{i}"))
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("acme", "r2"))
            heads = err.value.headers()
            assert heads == {"x-ratelimit-limit-requests": "2",
                             "x-ratelimit-remaining-requests": "0",
                             "x-ratelimit-reset-requests": "1m0s"}
            # as the tenant gate answers it 20 s later: the reset moved on
            assert err.value.headers(20.0)["x-ratelimit-reset-requests"] == "40s"
            assert (await h.queues.admit(make_request("free", "f"))).rate_limit_headers == {}

    run(scenario())


def test_the_quota_check_before_admission_gives_the_same_numbers() -> None:
    from router.state.quota_check import refuse_if_exhausted

    now = 1_000_000_000.0
    with pytest.raises(RateLimitError) as err:  # a used-up day
        refuse_if_exhausted([b"6", None, b"100"], [str(now + 20_000).encode(), None], b"100",
                            now)
    heads = err.value.headers()
    assert heads["x-ratelimit-remaining-tokens-day"] == "0"
    assert heads["x-ratelimit-remaining-requests"] == "4"  # 20 s of 60 spoken for
    assert heads["x-ratelimit-reset-requests"] == "20s"
    assert "x-ratelimit-limit-tokens" not in heads
    assert RateLimits(now).headers() == {}
