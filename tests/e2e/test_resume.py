"""Resumable streams on the real cluster: event ids, a client that hangs up and comes back
(by request id or by Idempotency-Key) gets exactly what followed, a detached request goes on
meanwhile and is cancelled once nobody comes back, and only its tenant may read it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from router.state.tenants import Tenant
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STORY = {"model": MODEL, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
         "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}


def headers(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def parse_sse(lines: list[str]) -> list[tuple[str | None, Any]]:
    """(id or None, payload) of each message; payload "[DONE]" or a dict."""
    messages, event_id = [], None
    for line in lines:
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            payload = line[5:].strip()
            messages.append((event_id, payload if payload == "[DONE]" else json.loads(payload)))
            event_id = None
    return messages


def text_of(messages: list[tuple[str | None, Any]]) -> str:
    return "".join(c.get("delta", {}).get("content") or ""
                   for _, m in messages if isinstance(m, dict) for c in m.get("choices", []))


async def read_some(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any],
                    num_events: int, extra: dict[str, str] | None = None
                    ) -> tuple[str, list[tuple[str | None, Any]]]:
    """Start a stream, read ``num_events`` token messages, then hang up."""
    lines: list[str] = []
    async with client.stream("POST", url, json={**body, "stream": True},
                             headers=headers(key, **(extra or {}))) as response:
        request_id = response.headers["x-fairserve-request-id"]
        async for line in response.aiter_lines():
            lines.append(line)
            if sum(1 for m in parse_sse(lines) if m[0] is not None) >= num_events:
                break
    return request_id, parse_sse(lines)


def full_run(e2e: E2ECluster, body: dict[str, Any]) -> str:
    response = httpx.post(f"{e2e.base_url}/chat/completions", json=body,
                          headers=headers(e2e.demo_key), timeout=300)
    return response.json()["choices"][0]["message"]["content"]


def test_every_message_but_the_openers_carries_an_increasing_event_id(e2e: E2ECluster) -> None:
    response = httpx.post(f"{e2e.base_url}/chat/completions", json={**STORY, "stream": True,
                          "max_tokens": 12}, headers=headers(e2e.demo_key), timeout=300)
    messages = parse_sse(response.text.splitlines())
    assert messages[0][0] is None and messages[0][1]["choices"][0]["delta"]["role"]
    ids = [i for i, _ in messages[1:]]
    assert None not in ids and messages[-1][1] == "[DONE]"
    # <stream id>;<the output tokens the client has>: a resume skips what it had
    order = [tuple(map(int, i.split(";")[0].split("-"))) for i in ids]
    assert order == sorted(order)
    positions = [int(i.split(";")[1]) for i in ids]
    assert positions == sorted(positions) and positions[-1] == 12


def test_a_client_that_hangs_up_resumes_with_last_event_id_and_misses_nothing(
        e2e: E2ECluster) -> None:
    expected = full_run(e2e, STORY)

    async def go() -> tuple[str, str]:
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{e2e.base_url}/chat/completions"
            request_id, first = await read_some(client, url, e2e.demo_key, STORY, 15)
            last_id = [i for i, _ in first if i is not None][-1]
            await asyncio.sleep(1.5)  # detached meanwhile: it goes on
            rest = await client.get(f"{url}/{request_id}", params={"stream": "true"},
                                    headers=headers(e2e.demo_key, **{"Last-Event-ID": last_id}))
            messages = parse_sse(rest.text.splitlines())
            assert not any(isinstance(m, dict) and "error" in m for _, m in messages), messages
            assert messages[-1][1] == "[DONE]"
            return text_of(first), text_of(messages)

    before, after = asyncio.run(go())
    assert before + after == expected


def test_an_idempotency_key_retry_with_last_event_id_resumes(e2e: E2ECluster) -> None:
    expected = full_run(e2e, STORY)

    async def go() -> str:
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{e2e.base_url}/chat/completions"
            key = {"Idempotency-Key": f"resume-{time.time_ns()}"}
            _, first = await read_some(client, url, e2e.demo_key, STORY, 10, key)
            last_id = [i for i, _ in first if i is not None][-1]
            again = await client.post(url, json={**STORY, "stream": True}, headers=headers(
                e2e.demo_key, **key, **{"Last-Event-ID": last_id}))
            return text_of(first) + text_of(parse_sse(again.text.splitlines()))

    assert asyncio.run(go()) == expected


def test_get_without_stream_waits_for_the_completion(e2e: E2ECluster) -> None:
    async def go() -> tuple[dict[str, Any], str]:
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{e2e.base_url}/chat/completions"
            request_id, first = await read_some(client, url, e2e.demo_key, STORY, 3)
            done = await client.get(f"{url}/{request_id}", headers=headers(e2e.demo_key))
            return done.json(), request_id

    body, request_id = asyncio.run(go())
    assert body["id"] == request_id and body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 60
    assert body["choices"][0]["message"]["content"] == full_run(e2e, STORY)


def test_a_request_nobody_comes_back_for_is_cancelled_after_the_grace(e2e: E2ECluster) -> None:
    body = {**STORY, "max_tokens": 400}

    async def go() -> str:
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{e2e.base_url}/chat/completions"
            request_id, _ = await read_some(client, url, e2e.demo_key, body, 3)
            return request_id

    request_id = asyncio.run(go())
    tenant = asyncio.run(e2e.request_record("demo", request_id))
    assert tenant.state.value in ("leased", "queued")  # still going while detached
    deadline = time.monotonic() + 60
    while asyncio.run(e2e.request_record("demo", request_id)).state.value != "cancelled":
        assert time.monotonic() < deadline, "a detached request was never cancelled"
        time.sleep(0.5)
    record = asyncio.run(e2e.request_record("demo", request_id))
    assert 0 < record.output_tokens_used < 400  # it ran while detached, then stopped


def test_only_the_owning_tenant_resumes_and_bad_positions_are_400(e2e: E2ECluster) -> None:
    other = e2e.add_tenant(Tenant(id="stranger"))
    response = httpx.post(f"{e2e.base_url}/chat/completions", json={**STORY, "max_tokens": 5},
                          headers=headers(e2e.demo_key), timeout=300)
    request_id = response.headers["x-fairserve-request-id"]
    url = f"{e2e.base_url}/chat/completions/{request_id}"
    assert httpx.get(url, headers=headers(other)).status_code == 404
    assert httpx.get(f"{e2e.base_url}/completions/{request_id}",
                     headers=headers(e2e.demo_key)).status_code == 404  # not a completion
    for bad, param in (("yesterday", "Last-Event-ID"), ("99999999999999-0", "Last-Event-ID"),
                       # past Redis's 64-bit ids, with positions (schemathesis found it a 503)
                       ("50604748182032260036-19677851514;0545032,7", "Last-Event-ID")):
        got = httpx.get(url, params={"stream": "true"},
                        headers=headers(e2e.demo_key, **{"Last-Event-ID": bad}))
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    got = httpx.get(url, params={"stream": "true", "starting_after": "x-1"},
                    headers=headers(e2e.demo_key))
    assert got.status_code == 400 and got.json()["error"]["param"] == "starting_after"
    reused = httpx.post(f"{e2e.base_url}/chat/completions", json={**STORY, "max_tokens": 6},
                        headers=headers(e2e.demo_key, **{"Idempotency-Key": "k-422"}))
    assert reused.status_code == 200
    reused = httpx.post(f"{e2e.base_url}/chat/completions", json={**STORY, "max_tokens": 7},
                        headers=headers(e2e.demo_key, **{"Idempotency-Key": "k-422"}))
    assert reused.status_code == 422 and reused.json()["error"]["param"] == "Idempotency-Key"
