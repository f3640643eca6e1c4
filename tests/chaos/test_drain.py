"""A redeploy under 16 streams (a changed engine setting, so every replica is replaced, and at
the same time a scale from 2 replicas to 1): no client sees it. Serve stops the old replicas
once their graceful shutdown timeout is over; what they still ran moves to the new ones from
the tokens already sent (router/dispatch/relay.py). Then SIGTERM of the one replica left (what
Kubernetes sends a pod it evicts) under 16 streams: they move to the replica Serve starts in
its place, and no client sees that either.

When it fails it says why in full (tests/chaos/report.py): the phase, every stream's figures
beside its reference, the replica processes, and where the cluster's logs were kept."""

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
from tests.chaos.report import PhaseReport, keep_cluster_logs
from tests.chaos.test_migration import MAX_TOKENS, NUM_STREAMS, bodies, references, settings
from tests.helm.chart import REPO

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

CHANGE = {"replicas": {"num_replicas": 1}, "engine": {"max_queue_wait_s": 45.0}}


async def redeploy_under_load(base: str, key: str, config: str, redis_url: str,
                              report: PhaseReport) -> list[StreamResult]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    report.results = results
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        report.mark("streams started")
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tests.chaos.redeploy", config, redis_url,
                             json.dumps(CHANGE)], cwd=REPO, capture_output=True, text=True,
            timeout=300)
        report.mark(f"redeploy returned rc={done.returncode}")
        assert done.returncode == 0 and "redeployed" in done.stdout, (
            report.explain(done.stdout + done.stderr))
        await asyncio.gather(*tasks)
        report.mark("streams ended")
    return results


async def sigterm_under_load(base: str, key: str, replica: int, report: PhaseReport
                             ) -> list[StreamResult]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    report.results = results
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        report.mark(f"streams started, SIGTERM to {replica}")
        kill(replica, signal.SIGTERM)
        await asyncio.gather(*tasks)
        report.mark("streams ended")
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


def check(results: list[StreamResult], expected: list[str], report: PhaseReport) -> None:
    """Every stream whole and equal to its reference; otherwise all of them in the message."""
    def whole(result: StreamResult, text: str) -> bool:
        return (result.status == 200 and not result.errors and result.num_done == 1
                and result.finish_reasons == ["length"] and result.text == text
                and result.usage is not None
                and result.usage["completion_tokens"] == MAX_TOKENS)

    cut = [i for i, (r, t) in enumerate(zip(results, expected, strict=True)) if not whole(r, t)]
    assert not cut, report.explain(f"streams {cut} were not whole")


def test_a_redeploy_a_scale_down_and_a_sigterm_under_16_streams_cut_no_stream(tmp_path) -> None:
    up, base, key, redis_url = start(tmp_path, settings(2))
    report = PhaseReport(tmp_path, up)
    try:
        expected = asyncio.run(references(base, key))
        report.expected = expected
        report.begin("redeploy and scale 2 -> 1")
        before = set(pids_titled(REPLICA_TITLE, up.process.pid))
        report.mark(f"replicas {sorted(before)}")
        results = asyncio.run(redeploy_under_load(base, key, str(tmp_path / "fairserve.yaml"),
                                                  redis_url, report))
        after = replicas_settled(before, up.process.pid)
        report.mark(f"replicas settled: {sorted(after)}")
        check(results, expected, report)
        fresh = after - before
        assert len(fresh) == 1 and len(after) == 1, report.explain(
            f"expected one new replica alone, found {sorted(after)} (before {sorted(before)})")

        report.begin("SIGTERM of the one replica")
        (replica,) = fresh
        check(asyncio.run(sigterm_under_load(base, key, replica, report)), expected, report)
    except BaseException:
        keep_cluster_logs(tmp_path, up.process.pid)
        raise
    finally:
        up.stop()
