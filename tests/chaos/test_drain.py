"""A redeploy under 16 streams (a changed engine setting, so every replica is replaced, and at
the same time a scale from 2 replicas to 1): no client sees it. The redeploy is prepared before
the streams start and lands while they run; the replicas' graceful shutdown timeout is 0, so
Serve kills each old replica 5 s after it starts stopping it (its own wait, ``cluster/app.py``)
while its streams are still running, and what they ran moves to the new replica from the tokens already
sent (router/dispatch/relay.py). The Router is replaced by the same redeploy: it keeps relaying
its clients' streams until they end. Then SIGTERM of the one replica left (what Kubernetes
sends a pod it evicts) under 16 streams: Ray lets the replica finish what it runs and exit,
and no client sees that either.

The test checks that each disruption really came while streams were open (a redeploy that
landed after the streams had ended would prove nothing), and when it fails it says why in full
(tests/chaos/report.py): the phase and its timeline, every stream's figures beside its
reference, the replica processes, and where the cluster's logs were kept."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

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
from tests.chaos.test_migration import NUM_STREAMS, bodies, references, settings
from tests.helm.chart import REPO

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

CHANGE = {"replicas": {"num_replicas": 1}, "engine": {"max_queue_wait_s": 45.0}}
# long enough that Serve stops the old replicas mid-stream on a fast CPU too (16 streams of
# 160 tokens take ~9 s at the 275 tok/s of a 2-core AMX machine, 11 s here; Serve's wait is 5 s)
MAX_TOKENS = 160
REDEPLOY_READY_S = 180.0
EXIT_WAIT_S = 60.0
WATCH_S = 0.25
RAY_TOKEN = Path.home() / ".ray" / "auth_token"  # a local Ray's token (Ray's token auth)


def drain_settings() -> dict[str, Any]:
    base = settings(2)
    base["replicas"]["graceful_shutdown_timeout_s"] = 0
    return base


async def kept_stream(client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any],
                      result: StreamResult) -> None:
    """A stream whose broken connection is kept as an error, beside the others' results."""
    try:
        await stream_chat(client, base, key, body, result)
    except httpx.HTTPError as exc:
        result.errors.append(f"connection: {exc!r}")


async def watch_exits(pids: set[int], under: int, results: list[StreamResult],
                      report: PhaseReport) -> dict[int, int]:
    """Until cancelled: when each of ``pids`` exits, the number of streams still open then."""
    exits: dict[int, int] = {}
    try:
        while len(exits) < len(pids):
            alive = set(await asyncio.to_thread(pids_titled, REPLICA_TITLE, under))
            for pid in pids - alive - exits.keys():
                exits[pid] = sum(1 for r in results if not r.num_done and not r.errors)
                report.mark(f"replica {pid} exited, {exits[pid]} streams open")
            await asyncio.sleep(WATCH_S)
    except asyncio.CancelledError:
        pass
    return exits


async def prepared_redeploy(config: Path, redis_url: str, report: PhaseReport
                            ) -> asyncio.subprocess.Process:
    """``tests.chaos.redeploy`` joined to the cluster, waiting for its go."""
    ray_address = json.loads((config.parent / "run.json").read_text())["ray_address"]
    env = dict(os.environ)
    if "RAY_AUTH_MODE" not in env and RAY_TOKEN.exists():
        env["RAY_AUTH_MODE"] = "token"  # what "auto" would find; a given address needs it said
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.chaos.redeploy", str(config), redis_url, ray_address,
        json.dumps(CHANGE), env=env, cwd=REPO, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), REDEPLOY_READY_S)
    if line.strip() != b"ready":
        process.kill()
        _, err = await process.communicate()
        raise AssertionError(report.explain(f"the redeploy did not get ready: {line!r}\n"
                                            f"{err.decode(errors='replace')[-3000:]}"))
    report.mark("redeploy ready")
    return process


async def redeploy_under_load(base: str, key: str, config: Path, redis_url: str,
                              report: PhaseReport, up_pid: int) -> dict[int, int]:
    """The streams, the redeploy once they run; the old replicas' exits (streams open then)."""
    before = set(pids_titled(REPLICA_TITLE, up_pid))
    report.mark(f"replicas {sorted(before)}")
    redeploy = await prepared_redeploy(config, redis_url, report)
    results = report.results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(kept_stream(client, base, key, body, result))
                 for body, result in zip(bodies(MAX_TOKENS), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        watcher = asyncio.create_task(watch_exits(before, up_pid, results, report))
        assert redeploy.stdin is not None
        redeploy.stdin.write(b"go\n")
        await redeploy.stdin.drain()
        report.mark("redeploy: go")
        out, err = await asyncio.wait_for(redeploy.communicate(), 300)
        report.mark(f"redeploy returned rc={redeploy.returncode}")
        assert redeploy.returncode == 0 and b"redeployed" in out, report.explain(
            (out + err).decode(errors="replace")[-3000:])
        await asyncio.gather(*tasks)
        report.mark("streams ended")
        return await exited(watcher, report, f"the old replicas {sorted(before)}")


async def sigterm_under_load(base: str, key: str, replica: int, report: PhaseReport,
                             up_pid: int) -> dict[int, int]:
    results = report.results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(kept_stream(client, base, key, body, result))
                 for body, result in zip(bodies(MAX_TOKENS), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        watcher = asyncio.create_task(watch_exits({replica}, up_pid, results, report))
        kill(replica, signal.SIGTERM)
        report.mark(f"SIGTERM to {replica}")
        await asyncio.gather(*tasks)
        report.mark("streams ended")
        return await exited(watcher, report, f"replica {replica} (SIGTERM)")


async def exited(watcher: asyncio.Task[dict[int, int]], report: PhaseReport, what: str
                 ) -> dict[int, int]:
    """The watcher's exits once every process it watches has exited, else a full report."""
    try:
        return await asyncio.wait_for(asyncio.shield(watcher), EXIT_WAIT_S)
    except TimeoutError:
        watcher.cancel()
        raise AssertionError(report.explain(
            f"{what} did not exit within {EXIT_WAIT_S:.0f} s of the streams' end")) from None


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
    up, base, key, redis_url = start(tmp_path, drain_settings())
    report = PhaseReport(tmp_path, up)
    pid = up.process.pid
    try:
        report.expected = asyncio.run(references(base, key, MAX_TOKENS))
        report.begin("redeploy and scale 2 -> 1")
        before = set(pids_titled(REPLICA_TITLE, pid))
        exits = asyncio.run(redeploy_under_load(base, key, tmp_path / "fairserve.yaml",
                                                redis_url, report, pid))
        check(report.results, report.expected, report)
        assert any(exits.values()), report.explain(
            "no old replica exited while streams were open: the redeploy cut through nothing")
        after = replicas_settled(before, pid)
        report.mark(f"replicas settled: {sorted(after)}")
        fresh = after - before
        assert len(fresh) == 1 and len(after) == 1, report.explain(
            f"expected one new replica alone, found {sorted(after)} (before {sorted(before)})")

        report.begin("SIGTERM of the one replica")
        (replica,) = fresh
        asyncio.run(sigterm_under_load(base, key, replica, report, pid))
        check(report.results, report.expected, report)
    except BaseException:
        keep_cluster_logs(tmp_path, pid)
        raise
    finally:
        up.stop()
