"""A redeploy under 16 streams (a changed engine setting, so every replica is replaced, and at
the same time a scale from 2 replicas to 1): no client sees it. Serve stops the old replicas
once their graceful shutdown timeout is over; what they still ran moves to the new ones from
the tokens already sent (router/dispatch/relay.py). Then SIGTERM of the one replica left (what
Kubernetes sends a pod it evicts) under 16 streams: they move to the replica Serve starts in
its place, and no client sees that either."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.chaos.factories import (
    REPLICA_TITLE,
    StreamResult,
    kill,
    pids_titled,
    start,
    stream_chat,
    wait_for_tokens,
)
from tests.chaos.test_migration import MAX_TOKENS, NUM_STREAMS, bodies, references, settings
from tests.helm.chart import REPO

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

CHANGE = {"replicas": {"num_replicas": 1}, "engine": {"max_queue_wait_s": 45.0}}


async def redeploy_under_load(base: str, key: str, config: str, redis_url: str
                              ) -> list[StreamResult]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tests.chaos.redeploy", config, redis_url,
                             json.dumps(CHANGE)], cwd=REPO, capture_output=True, text=True,
            timeout=300)
        assert done.returncode == 0 and "redeployed" in done.stdout, done.stdout + done.stderr
        await asyncio.gather(*tasks)
    return results


async def sigterm_under_load(base: str, key: str, replica: int) -> list[StreamResult]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        kill(replica, signal.SIGTERM)
        await asyncio.gather(*tasks)
    return results


def replicas_settled(before: set[int], under: int, timeout_s: float = 60.0) -> set[int]:
    """The replica processes once the old ones have exited (Serve returns from a redeploy
    when the new replicas run; the old ones may still be finishing their shutdown)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = set(pids_titled(REPLICA_TITLE, under))
        if (len(now) == 1 and not (now & before)) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def check(results: list[StreamResult], expected: list[str]) -> None:
    for i, (result, text) in enumerate(zip(results, expected, strict=True)):
        assert result.status == 200 and not result.errors, (i, result.errors)
        assert result.num_done == 1 and result.finish_reasons == ["length"], (i, result)
        assert result.text == text, (i, result.text, text)
        assert result.usage["completion_tokens"] == MAX_TOKENS, (i, result.usage)


def test_a_redeploy_a_scale_down_and_a_sigterm_under_16_streams_cut_no_stream(tmp_path) -> None:
    up, base, key, redis_url = start(tmp_path, settings(2))
    try:
        expected = asyncio.run(references(base, key))
        before = set(pids_titled(REPLICA_TITLE, up.process.pid))
        results = asyncio.run(redeploy_under_load(base, key, str(tmp_path / "fairserve.yaml"),
                                                  redis_url))
        after = replicas_settled(before, up.process.pid)
        (fresh,) = after - before  # one new replica took over
        check(results, expected)

        check(asyncio.run(sigterm_under_load(base, key, fresh)), expected)
    finally:
        up.stop()
