"""OpenAI's rate-limit headers on the real cluster, read with the ``openai`` SDK's raw
responses: on whole and streamed answers, on the Responses API, and on the 429 (with
Retry-After); their numbers move as requests are admitted, and what the 429's reset names
comes back when it has passed. A tenant without limits gets none."""

from __future__ import annotations

import time

import openai
import pytest

from router.state.tenants import Tenant
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ASK = {"model": MODEL, "max_tokens": 4, "temperature": 0,
       "messages": [{"role": "user", "content": "Say hi."}]}


def seconds(text: str) -> float:
    """A header's duration (``20s``, ``1m0s``, ``250ms``) in seconds."""
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    total, number = 0.0, ""
    for ch in text:
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
    return total


def test_the_headers_move_with_each_request_and_the_429_carries_them(e2e: E2ECluster) -> None:
    key = e2e.add_tenant(Tenant(id="paced", rpm=3, tpm=100_000, daily_tokens=1_000_000))
    client = e2e.client(key)

    first = client.chat.completions.with_raw_response.create(**ASK)
    usage = first.parse().usage
    reserved = usage.prompt_tokens + ASK["max_tokens"]
    heads = first.headers
    assert heads["x-ratelimit-limit-requests"] == "3"
    assert heads["x-ratelimit-remaining-requests"] == "2"
    assert 19 < seconds(heads["x-ratelimit-reset-requests"]) <= 20
    assert heads["x-ratelimit-limit-tokens"] == "100000"
    assert heads["x-ratelimit-remaining-tokens"] == str(100_000 - reserved)
    assert heads["x-ratelimit-limit-tokens-day"] == "1000000"
    assert heads["x-ratelimit-remaining-tokens-day"] == str(1_000_000 - reserved)
    assert 0 < seconds(heads["x-ratelimit-reset-tokens-day"]) <= 86_400

    streamed = client.chat.completions.with_raw_response.create(**ASK, stream=True)
    assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
    assert [c for c in streamed.parse() if c.choices]  # the stream itself, read to its end
    third = client.responses.with_raw_response.create(model=MODEL, input="Say hi.",
                                                      max_output_tokens=4, store=False)
    assert third.headers["x-ratelimit-remaining-requests"] == "0"

    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**ASK)
    heads = refused.value.response.headers
    assert heads["x-ratelimit-reason"] == "rpm"
    assert heads["x-ratelimit-remaining-requests"] == "0"
    wait = seconds(heads["x-ratelimit-reset-requests"])
    assert 40 < wait <= 60  # three requests of 20 s each spoken for, a little of it gone
    assert 1 <= int(heads["retry-after"]) <= 20  # one request's worth comes back first

    time.sleep(int(heads["retry-after"]) + 0.5)  # what Retry-After named has come back
    again = client.chat.completions.with_raw_response.create(**ASK)
    assert again.headers["x-ratelimit-remaining-requests"] == "0"  # that one, now used


def test_a_tenant_without_limits_gets_no_rate_limit_headers(e2e: E2ECluster) -> None:
    key = e2e.add_tenant(Tenant(id="unmetered"))
    reply = e2e.client(key).chat.completions.with_raw_response.create(**ASK)
    assert not [name for name in reply.headers if name.startswith("x-ratelimit")]
