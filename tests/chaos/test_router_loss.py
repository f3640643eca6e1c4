"""kill -9 of the router process that holds 16 streaming clients: every client reconnects with
the last event id it saw and, in the end, has received exactly the uninterrupted text. The
router's leases expire, another dispatcher takes the requests over from their response
streams (router/dispatch/relay.py) and goes on from the tokens the clients already have."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from tests.chaos.factories import (
    ROUTER_TITLE,
    StreamResult,
    assert_exact,
    kill,
    pids_titled,
    resilient_stream,
    start,
    wait_for_tokens,
)
from tests.chaos.test_migration import MAX_TOKENS, NUM_STREAMS, bodies, references

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]


def settings() -> dict:
    return {
        "engine": {"num_threads": 1, "max_num_seqs": 32},
        "replicas": {"num_replicas": 2, "num_cpus": 0.5, "max_ongoing_requests": NUM_STREAMS},
        "router": {"num_replicas": 1, "num_cpus": 0.25,
                   "api": {"detach_grace_s": 120},
                   "dispatch": {"reap_s": 0.5, "renew_s": 1.0}},
        "queues": {"lease_ms": 3000},  # a dead router's requests come back within seconds
    }


async def kill_the_router(base: str, key: str, up_pid: int
                          ) -> tuple[list[StreamResult], list[int]]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=60)) as client:
        tasks = [asyncio.create_task(resilient_stream(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        (router,) = pids_titled(ROUTER_TITLE, up_pid)
        kill(router, signal.SIGKILL)
        reconnects = await asyncio.gather(*tasks)
    return results, reconnects


def test_kill_9_of_the_router_holding_16_streams_clients_resume_and_miss_nothing(
        tmp_path) -> None:
    up, base, key, _ = start(tmp_path, settings())
    try:
        expected = asyncio.run(references(base, key))
        results, reconnects = asyncio.run(kill_the_router(base, key, up.process.pid))
        assert sum(reconnects) >= NUM_STREAMS  # every client lost its connection
        assert_exact(results, expected, MAX_TOKENS)
    finally:
        up.stop()
