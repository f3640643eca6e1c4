"""A frozen replica (SIGSTOP) under 16 streams: the relays see no chunk and no heartbeat, move
every request it held to the other replica, and no client notices; then SIGCONT, and nothing
is written twice. A slow but healthy engine (a long prefill gives no chunk for seconds, and its
last chunks each take longer than the stall timeout) is left alone: no migration."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.chaos.factories import (
    MODEL,
    REPLICA_TITLE,
    StreamResult,
    kill,
    metrics_url,
    pids_titled,
    start,
    stream_chat,
    wait_for_tokens,
)
from tests.chaos.test_migration import MAX_TOKENS, NUM_STREAMS, bodies, references, settings
from tests.cluster.factories import UpProcess

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

# below the longest steps here on purpose: a 512-token chunk deep into a 4,200-token prompt takes
# ~4 s on one core of a 2-core EPYC (the first ~1 s): the engine's layers, which it counts, are
# what tells the relay that it works (a layer takes ~0.15 s); a frozen replica reports nothing
STALL_TIMEOUT_S = 2.5
PREFILL_CHUNK = 512
FROZEN_WAIT_S = 60.0  # the stall timeout, a migration and the rest of 16 streams, with margin


def hang_settings() -> dict:
    base = settings(2)
    base["router"]["dispatch"]["stall_timeout_s"] = STALL_TIMEOUT_S
    base["engine"]["max_num_batched_tokens"] = PREFILL_CHUNK
    return base


def migration_lines(up: UpProcess) -> list[str]:
    """The migrations counter's lines (each with its labels: the tenant and why)."""
    text = httpx.get(metrics_url(up), timeout=30).text
    return [line for line in text.splitlines() if line.startswith("fairserve_migrations_total")]


def migrations(up: UpProcess) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in migration_lines(up))


async def freeze_a_replica(base: str, key: str, up_pid: int) -> list[StreamResult]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        (victim, *_) = pids_titled(REPLICA_TITLE, up_pid)
        kill(victim, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            await asyncio.gather(*tasks)
            # no moved request went back to the frozen replica (``ReplicaCall.avoid``): one that
            # did waited for Ray Serve's health checks to drop it, ~100 s here (all were done
            # within ~7 s of the freeze otherwise)
            waited_s = time.monotonic() - frozen_at
            assert waited_s < FROZEN_WAIT_S, f"streams ended {waited_s:.0f} s after the freeze"
        finally:
            kill(victim, signal.SIGCONT)
    return results


def test_sigstop_of_a_replica_moves_its_streams_and_a_long_prefill_does_not(tmp_path) -> None:
    up, base, key, _ = start(tmp_path, hang_settings())
    try:
        # slow but healthy: a prompt of ~4,200 tokens prefills in 9 steps of 512 tokens: no
        # chunk for 10-30 s (by the machine), far past the stall timeout, and the last steps
        # are longer than it too, but every model layer of them counts as progress
        long = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "user", "content": "Summarise: " + "the quick brown fox jumps. " * 700}]}
        started = time.monotonic()
        reply = httpx.post(f"{base}/chat/completions", json=long, timeout=300,
                           headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started > 1.5 * STALL_TIMEOUT_S  # the silence was long
        assert reply.json()["usage"]["prompt_tokens"] > 4000
        assert migrations(up) == 0, migration_lines(up)

        expected = asyncio.run(references(base, key))
        results = asyncio.run(freeze_a_replica(base, key, up.process.pid))
        for i, (result, text) in enumerate(zip(results, expected, strict=True)):
            assert result.status == 200 and not result.errors, (i, result.errors)
            assert result.num_done == 1 and result.finish_reasons == ["length"], (i, result)
            assert result.text == text, (i, result.text, text)
            assert result.usage["completion_tokens"] == MAX_TOKENS, (i, result.usage)
        assert migrations(up) >= 1
    finally:
        up.stop()
