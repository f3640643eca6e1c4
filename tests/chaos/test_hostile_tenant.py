"""A hostile tenant beside a quiet one, on the real cluster (``make up``'s shape: one model
replica, one router behind HAProxy, the embedded Redis).

Tenant B sends one short streamed request after another and measures its time to first token,
first alone, then while tenant A (``tests/chaos/hostile.py``, a process of its own) keeps 2,000
streams open at once and reopens them as they end, joins its own long request with Idempotency-Key
retries and resumes it by the hundred, and sends a 1 MiB prompt, a body over 1 MiB, the largest
and deepest schema allowed and the most and longest stop strings, one after another. A has the
quotas an operator gives a tenant it does not trust (a tokens-per-minute limit; the caps on open
streams and resumes are the defaults).

Goals (issue "tenants cannot hurt or see each other"): B's median time to first token beside A
within 1.5x of its median alone; B never refused; A only ever answered 200, 400, 413 or 429 (never
a 5xx, never a dropped connection) and held to its caps; the router's memory bounded; and
afterwards nothing left behind (no lease, queue entry, reader, slot, engine sequence or KV block).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from cluster.launcher import add_tenant_with_key
from router.state.tenants import Tenant
from tests.chaos.factories import MODEL, ROUTER_TITLE, leftovers, pids_titled, rss_mb, start

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

ATTACK_S = 45.0
SOLO_REQUESTS = 12
HOSTILE_TPM = 2_400  # 40 tokens a second: about a sixth of what the engine makes on 2 cores
ALLOWED = {"200", "400", "413", "429"}


def settings() -> dict:
    return {"router": {"api": {"detach_grace_s": 5}}}


async def time_to_first_token(http: httpx.AsyncClient, base: str, key: str, n: int) -> float:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Say hello to guest number {n}."}]}
    started = time.monotonic()
    first = None
    async with http.stream("POST", f"{base}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, (response.status_code, await response.aread())
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and line[5:].strip() != "[DONE]" \
                    and any(c["delta"].get("content") for c in json.loads(line[5:])["choices"]):
                first = time.monotonic() - started
    assert first is not None, "no token"
    return first


async def quiet_tenant(base: str, key: str, count: int | None = None,
                       until: float | None = None) -> list[float]:
    """B's times to first token: ``count`` requests, or as many as start before ``until``."""
    found: list[float] = []
    async with httpx.AsyncClient(timeout=120) as http:
        for n in range(2):  # warm: the prompt's first blocks, the connection
            await time_to_first_token(http, base, key, 1000 + n)
        n = 0
        while (count is not None and n < count) or (until is not None and
                                                     time.monotonic() < until):
            found.append(await time_to_first_token(http, base, key, n))
            n += 1
            await asyncio.sleep(0.25)
    return found


def test_a_hostile_tenant_cannot_slow_the_quiet_one(tmp_path) -> None:
    up, base, _, redis_url = start(tmp_path, settings())
    try:
        quiet_key = add_tenant_with_key(redis_url, Tenant(id="quiet"))
        hostile_key = add_tenant_with_key(redis_url, Tenant(id="hostile", tpm=HOSTILE_TPM))
        (router_pid,) = pids_titled(ROUTER_TITLE, under=up.process.pid)
        solo = asyncio.run(quiet_tenant(base, quiet_key, count=SOLO_REQUESTS))
        rss_start = rss_mb(router_pid)

        out = tmp_path / "hostile.json"
        attacker = subprocess.Popen([sys.executable, "-m", "tests.chaos.hostile", base,
                                     hostile_key, str(out), "--seconds", str(ATTACK_S)])
        try:
            time.sleep(5)  # the flood is open
            peak = [rss_start]

            async def watch(until: float) -> None:
                while time.monotonic() < until:
                    peak[0] = max(peak[0], rss_mb(router_pid))
                    await asyncio.sleep(0.5)

            async def beside() -> list[float]:
                until = time.monotonic() + ATTACK_S - 10
                found, _ = await asyncio.gather(quiet_tenant(base, quiet_key, until=until),
                                                watch(until))
                return found

            flooded = asyncio.run(beside())
            assert attacker.wait(timeout=600) == 0
        finally:
            if attacker.poll() is None:
                attacker.kill()
        report = json.loads(out.read_text())
        by_kind = report["by_kind"]
        held = asyncio.run(leftovers(redis_url, ("quiet", "hostile")))
        solo_ms, flooded_ms = (1000 * statistics.median(solo), 1000 * statistics.median(flooded))
        print(f"\nhostile tenant: quiet tenant's time to first token, median {solo_ms:.0f} ms "
              f"alone ({len(solo)}), {flooded_ms:.0f} ms beside the attack ({len(flooded)}): "
              f"x{flooded_ms / solo_ms:.2f}; router RSS {rss_start:.0f} -> peak {peak[0]:.0f} "
              f"MB; attacker's answers {by_kind}; median seconds {report['median_s']}")
        print(json.dumps(report["samples"], indent=1))

        for kind, outcomes in by_kind.items():  # "429 <code>": which limit answered
            assert {o.split()[0] for o in outcomes} <= ALLOWED, (kind, outcomes)
        assert sum(n for o, n in by_kind["stream"].items() if o.startswith("429")) > 0
        assert by_kind["1mib_prompt"].keys() <= {"400", "429 tpm"}, by_kind["1mib_prompt"]
        assert by_kind["over_1mib"].keys() <= {"413"}, by_kind["over_1mib"]
        assert by_kind["join"].get("429 readers", 0) > 0, by_kind["join"]
        assert by_kind["resume"].get("429 readers", 0) > 0, by_kind["resume"]
        assert not held, held
        assert peak[0] - rss_start < 200, (rss_start, peak[0])  # MB
        assert flooded_ms <= 1.5 * solo_ms, (solo, flooded)
    finally:
        up.stop()
