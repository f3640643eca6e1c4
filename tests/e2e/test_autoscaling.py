"""Autoscaling on the Redis backlog, end to end: a cluster started as a user starts it
(``fairserve up --config``) with scale-to-zero, the default model, fractional CPUs.

One cluster walks through the whole cycle, each step checked as it happens:
1. it comes up with no replica; ``/ready`` says so and stays ready (scale-from-zero allowed);
2. a request at zero replicas waits in its queue (no error) while a replica starts, and is served;
3. a burst of queued work takes it from 1 to 2 replicas; the time from the backlog rising to the
   new replica serving its first request is measured and printed;
4. the backlog drains; under a trickle of requests it scales back down to 1 after the delay,
   and no request fails or is lost while the replica is removed;
5. idle, it returns to zero.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from cluster.autoscaling import AutoscaleSettings
from router.state import keys
from router.state.capacity import read_loads
from router.state.redis_client import connect
from tests.cluster.factories import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
# long enough on one replica (~50 tokens/s here) to outlast a second replica's start (~8 s
# while the first one is busy, more on a loaded CI machine)
BURST, BURST_TOKENS = 60, 64
SCALING = AutoscaleSettings(min_replicas=0, max_replicas=2, allow_scale_to_zero=True,
                            target_drain_s=5.0, upscale_delay_s=1.0, downscale_delay_s=8.0,
                            initial_tokens_per_s=60.0, metrics_interval_s=0.5)


def _config(path: Path) -> Path:
    config = {
        "engine": {"num_threads": 1, "max_num_seqs": 8, "kv_cache_bytes": 256 * 2**20},
        "replicas": {"num_cpus": 0.5, "max_ongoing_requests": 8,
                     "graceful_shutdown_timeout_s": 30, "autoscaling": SCALING.model_dump()},
        "router": {"num_replicas": 1, "num_cpus": 0.25},
    }
    file = path / "fairserve.yaml"
    file.write_text(yaml.safe_dump(config))
    return file


class Watch:
    """The cluster as Redis shows it: live replicas and what they hold."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    async def loads(self):
        client = connect(self.redis_url)
        try:
            return await read_loads(client)
        finally:
            await client.aclose()

    async def until(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            loads = await self.loads()
            if predicate(loads):
                return loads
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {timeout_s} s: {loads}")
            await asyncio.sleep(0.2)

    async def decision(self) -> dict:
        client = connect(self.redis_url)
        try:
            raw = await client.get(keys.autoscaler())
            return json.loads(raw) if raw else {}
        finally:
            await client.aclose()


async def _ask(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> int:
    response = await client.completions.create(
        model=MODEL, prompt=f"Request {i}: list some numbers.", max_tokens=max_tokens,
        extra_body={"min_tokens": max_tokens}, temperature=0.0)
    return response.usage.completion_tokens


async def _walk(base_url: str, key: str, redis_url: str) -> None:
    watch = Watch(redis_url)
    root = base_url.removesuffix("/v1")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    async with httpx.AsyncClient(timeout=30) as http:
        # 1. no replica, and ready all the same
        assert await watch.loads() == []
        ready = await http.get(f"{root}/ready")
        assert ready.status_code == 200 and ready.json()["replicas"] == 0, ready.text

        # 2. a request at zero waits for a replica and is served
        start = time.monotonic()
        assert await _ask(client, 0, 8) == 8
        print(f"\nscale from zero: first request served in {time.monotonic() - start:.1f} s")
        assert len(await watch.loads()) == 1

        # 3. a burst: 1 -> 2 replicas, reaction time measured
        (first,) = await watch.loads()
        start = time.monotonic()
        burst = [asyncio.create_task(_ask(client, i, BURST_TOKENS)) for i in range(1, BURST + 1)]
        loads = await watch.until(
            lambda loads: any(x.replica_id != first.replica_id and x.ongoing > 0
                              for x in loads), 120, "serving on a second replica")
        reaction_s = time.monotonic() - start
        decision = await watch.decision()
        print(f"backlog rise -> new replica serving its first request: {reaction_s:.1f} s "
              f"(decision: {decision.get('decision_reason')}, queued "
              f"{decision.get('queued_tokens')} tokens)")
        assert len(loads) == 2
        assert await asyncio.gather(*burst) == [BURST_TOKENS] * BURST, "every request served"

        # 4. under a trickle it scales back to one replica, and nothing fails
        stop = asyncio.Event()
        served: list[int] = []

        async def trickle(i: int) -> None:
            while not stop.is_set():
                served.append(await _ask(client, 1000 + i, 4))

        trickles = [asyncio.create_task(trickle(i)) for i in range(2)]
        await watch.until(lambda loads: len(loads) == 1, 120, "down to one replica")
        await asyncio.sleep(2.0)  # and a few more requests on the one left
        stop.set()
        await asyncio.gather(*trickles)  # raises if any request failed
        assert served and set(served) == {4}

        # 5. idle: back to zero, still ready
        await watch.until(lambda loads: loads == [], 120, "down to zero replicas")
        deadline = time.monotonic() + 5.0  # the router re-reads load reports every 0.25 s
        while True:
            ready = await http.get(f"{root}/ready")
            assert ready.status_code == 200, ready.text
            if ready.json()["replicas"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        assert ready.json()["replicas"] == 0, ready.text
    await client.close()


def test_backlog_scales_out_and_back_to_zero_without_losing_a_request(tmp_path) -> None:
    up = UpProcess(tmp_path, "--config", str(_config(tmp_path)))
    try:
        out = up.wait_ready()
        assert "ready in" in out, out
        run = json.loads((tmp_path / "run.json").read_text())
        key = (tmp_path / "demo-key").read_text().strip()
        asyncio.run(_walk(run["base_url"], key, run["redis_url"]))
        status = up.cli("status", "--state-dir", str(tmp_path))
        assert "autoscaler:" in status.stdout, status.stdout
    finally:
        up.stop()
