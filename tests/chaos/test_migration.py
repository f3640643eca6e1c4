"""kill -9 of a model replica under 16 streams: no client sees it. Each request resumes on
another replica (or the same one, restarted by Ray) from the tokens it had sent, and every
client's text equals the same request's uninterrupted run, with one finish reason, one
[DONE], no error and a usage that counts each token once. Greedy and seeded."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

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

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

NUM_STREAMS = 16
MAX_TOKENS = 48
TOPICS = ["a lighthouse", "the moon", "a red fox", "a city at night", "an old clock",
          "a river", "a mountain village", "a violin", "the first snow", "a ship", "a garden",
          "a library", "a desert", "a train", "an island", "a bakery"]


def settings(num_replicas: int) -> dict[str, Any]:
    return {
        "engine": {"num_threads": 1, "max_num_seqs": 32},
        "replicas": {"num_replicas": num_replicas, "num_cpus": 0.5,
                     "max_ongoing_requests": NUM_STREAMS, "graceful_shutdown_timeout_s": 5},
        "router": {"num_replicas": 1, "num_cpus": 0.25,
                   "dispatch": {"max_migrations": 3, "stall_timeout_s": 10}},
    }


def bodies(max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    out = []
    for i, topic in enumerate(TOPICS[:NUM_STREAMS]):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}
        out.append({"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, **sampling,
                    "messages": [{"role": "user", "content": f"Tell me a story about {topic}."}],
                    "stream_options": {"include_usage": True}})
    return out


async def references(base: str, key: str, max_tokens: int = MAX_TOKENS) -> list[str]:
    """The texts with nothing killed (all at once: the engine's batched output equals each
    request's alone, which the engine's parity tests show)."""
    results = [StreamResult() for _ in bodies(max_tokens)]
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(stream_chat(client, base, key, body, result)
                               for body, result in zip(bodies(max_tokens), results,
                                                       strict=True)))
    for result in results:
        assert not result.errors and result.num_done == 1, result.errors
    return [result.text for result in results]


async def kill_a_replica_under_load(base: str, key: str, up_pid: int
                                    ) -> tuple[list[StreamResult], int]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        (victim, *_) = pids_titled(REPLICA_TITLE, up_pid)
        kill(victim, signal.SIGKILL)
        await asyncio.gather(*tasks)
    return results, victim


def check(results: list[StreamResult], expected: list[str]) -> None:
    for i, (result, text) in enumerate(zip(results, expected, strict=True)):
        assert result.status == 200 and not result.errors, (i, result.errors)
        assert result.num_done == 1 and result.finish_reasons == ["length"], (i, result)
        assert result.text == text, (i, result.text, text)
        assert result.usage is not None and result.usage["completion_tokens"] == MAX_TOKENS, (
            i, result.usage)


@pytest.mark.parametrize("num_replicas", [2, 1], ids=["two-replicas", "one-restarted"])
def test_kill_9_of_a_replica_under_16_streams_is_invisible_to_clients(tmp_path,
                                                                       num_replicas) -> None:
    up, base, key, _ = start(tmp_path, settings(num_replicas))
    try:
        expected = asyncio.run(references(base, key))
        before = pids_titled(REPLICA_TITLE, up.process.pid)
        assert len(before) == num_replicas
        results, victim = asyncio.run(kill_a_replica_under_load(base, key, up.process.pid))
        check(results, expected)
        assert victim not in pids_titled(REPLICA_TITLE, up.process.pid)  # it really died
        metrics = httpx.get(metrics_url(up), timeout=30).text
        migrated = [line for line in metrics.splitlines()
                    if line.startswith("fairserve_migrations_total")]
        assert migrated and sum(float(line.rsplit(" ", 1)[1]) for line in migrated) >= 1
    finally:
        up.stop()
