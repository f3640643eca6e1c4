"""Four routers behind the one address (HAProxy), 64 streams spread over them; kill -9 of one
router, then, while the clients are back and streaming, of a second: every client reconnects
(``GET .../{id}`` with its last event id, through the same address, so to whichever router is
up) and ends with exactly the text of the uninterrupted run, no event twice."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import pytest

from tests.chaos.factories import (
    MODEL,
    ROUTER_TITLE,
    StreamResult,
    assert_exact,
    kill,
    pids_titled,
    resilient_stream,
    start,
    stream_chat,
    wait_for_tokens,
)
from tests.chaos.test_migration import TOPICS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

NUM_ROUTERS = 4
NUM_STREAMS = 64
MAX_TOKENS = 40


def settings() -> dict[str, Any]:
    return {
        "engine": {"num_threads": 1, "max_num_seqs": NUM_STREAMS},
        "replicas": {"num_replicas": 1, "num_cpus": 0.5, "max_ongoing_requests": NUM_STREAMS},
        "router": {"num_replicas": NUM_ROUTERS, "num_cpus": 0.25,
                   "api": {"detach_grace_s": 120}, "dispatch": {"reap_s": 0.5, "renew_s": 1.0}},
        "queues": {"lease_ms": 3000},  # a dead router's requests come back within seconds
    }


def bodies() -> list[dict[str, Any]]:
    out = []
    for i in range(NUM_STREAMS):
        topic = TOPICS[i % len(TOPICS)]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 300 + i}
        out.append({"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling,
                    "messages": [{"role": "user", "content":
                                  f"Tell story number {i // len(TOPICS)} about {topic}."}],
                    "stream_options": {"include_usage": True}})
    return out


async def references(base: str, key: str) -> list[str]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(stream_chat(client, base, key, body, result)
                               for body, result in zip(bodies(), results, strict=True)))
    for i, result in enumerate(results):  # the uninterrupted run itself is whole
        assert not result.errors and result.num_done == 1, (i, result.errors)
        assert result.finish_reasons == ["length"], (i, result.event_ids, result.events)
        assert result.usage and result.usage["completion_tokens"] == MAX_TOKENS, (i, result)
    return [result.text for result in results]


async def kill_two_routers(base: str, key: str, up_pid: int
                           ) -> tuple[list[StreamResult], list[int], list[int]]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=60), limits=limits) as client:
        tasks = [asyncio.create_task(resilient_stream(client, base, key, body, result,
                                                      timeout_s=400))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=180)
        routers = pids_titled(ROUTER_TITLE, up_pid)
        assert len(routers) == NUM_ROUTERS, routers
        kill(routers[0], signal.SIGKILL)
        # the clients are back (each has more text than when the first died), then the second
        await wait_for_tokens(results, min_chars=24, timeout_s=240)
        kill(routers[1], signal.SIGKILL)
        reconnects = await asyncio.gather(*tasks)
    return results, reconnects, routers[:2]


def test_four_routers_lose_two_and_every_client_resumes_exact(tmp_path) -> None:
    up, base, key, _ = start(tmp_path, settings())
    try:
        expected = asyncio.run(references(base, key))
        results, reconnects, killed = asyncio.run(kill_two_routers(base, key, up.process.pid))
        print(f"\nmany routers: killed {killed}; reconnects per client {sorted(reconnects)}")
        assert sum(reconnects) >= NUM_STREAMS // 2  # about half the clients were on them
        assert_exact(results, expected, MAX_TOKENS)
    finally:
        up.stop()
