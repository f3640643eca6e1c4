"""Overload: a bounded loop of clients at 10x the cluster's capacity (its replica slots), then
one tenant alone flooding at 20x while two quiet tenants go on. Clients only ever see 200, 429
or 503, each refusal with Retry-After (and they honour it); the quiet tenants see no refusal
and keep the goodput they have beside that tenant when it only fills the cluster (1x: the
engine's batch is as full, so what is compared is what the 19x beyond capacity costs them); the router's memory stays bounded; once the load stops, no lease,
queue entry, replica slot, engine sequence or KV block is left behind."""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from dataclasses import dataclass, field

import httpx
import pytest

from cluster.launcher import add_tenant_with_key
from router.state.tenants import Tenant
from tests.chaos.factories import MODEL, ROUTER_TITLE, leftovers, pids_titled, rss_mb, start

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

SLOTS = 4  # one replica taking 4 requests at once: the cluster's capacity
MAX_QUEUED = 4  # below the 8 clients each tenant runs at 10x: some are refused
PHASE_S = 12.0
QUIET = ("quiet-a", "quiet-b")
ALLOWED = {200, 429, 503}


def overload_settings() -> dict:
    return {
        "engine": {"num_threads": 1, "max_num_seqs": 32},
        "replicas": {"num_replicas": 1, "num_cpus": 0.5, "max_ongoing_requests": SLOTS},
        "router": {"num_replicas": 1, "num_cpus": 0.25},
    }


def body(i: int) -> dict:
    return {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Count to {i % 7 + 3}."}]}


@dataclass
class Tally:
    statuses: collections.Counter = field(default_factory=collections.Counter)
    missing_retry_after: int = 0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.statuses[200]


async def client_loop(http: httpx.AsyncClient, base: str, key: str, tally: Tally,
                      until: float, seed: int) -> None:
    """One client: a request, then the next; a refusal waits its Retry-After."""
    i = seed
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            response = await http.post(f"{base}/chat/completions", json=body(i),
                                       headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as exc:  # a client must never see the cluster break
            tally.statuses[type(exc).__name__] += 1
            return
        i += 1
        tally.statuses[response.status_code] += 1
        if response.status_code == 200:
            tally.latencies_s.append(time.monotonic() - started)
            continue
        retry_after = response.headers.get("retry-after")
        if retry_after is None:
            tally.missing_retry_after += 1
            await asyncio.sleep(1.0)
            continue
        await asyncio.sleep(min(float(retry_after), max(0.0, until - time.monotonic())))


async def run_phase(base: str, clients: dict[str, tuple[str, int]], router_pid: int
                    ) -> tuple[dict[str, Tally], float]:
    """``clients``: tenant -> (key, number of concurrent clients). Returns the tallies and the
    router's peak RSS (MB) over the phase."""
    tallies = {tenant: Tally() for tenant in clients}
    until = time.monotonic() + PHASE_S
    peak = rss_mb(router_pid)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(client_loop(http, base, key, tallies[tenant], until, 100 * n))
                 for tenant, (key, count) in clients.items() for n in range(count)]
        while not all(t.done() for t in tasks):
            peak = max(peak, rss_mb(router_pid))
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
    return tallies, peak


def check_refusals(tallies: dict[str, Tally]) -> None:
    for tenant, tally in tallies.items():
        assert set(tally.statuses) <= ALLOWED, (tenant, tally.statuses)
        assert tally.missing_retry_after == 0, (tenant, tally.statuses)


def test_overload_only_refuses_and_leaves_nothing(tmp_path) -> None:
    up, base, _, redis_url = start(tmp_path, overload_settings())
    try:
        tenant_keys = {t: add_tenant_with_key(redis_url, Tenant(id=t, max_queued=MAX_QUEUED))
                       for t in (*QUIET, "noisy", "c", "d")}
        (router_pid,) = pids_titled(ROUTER_TITLE, under=up.process.pid)
        rss_start = rss_mb(router_pid)

        # 10x: 40 clients over five tenants
        ten_x, peak_ten_x = asyncio.run(run_phase(base, {
            t: (k, 8) for t, k in tenant_keys.items()}, router_pid))
        check_refusals(ten_x)
        assert all(tally.ok > 0 for tally in ten_x.values()), ten_x  # every tenant served
        assert sum(t.statuses[429] for t in ten_x.values()) > 0, ten_x  # it was overloaded

        # the quiet tenants beside one tenant filling the cluster (1x), then flooding it (20x)
        quiet = {t: (tenant_keys[t], 1) for t in QUIET}
        solo, _ = asyncio.run(run_phase(
            base, {**quiet, "noisy": (tenant_keys["noisy"], SLOTS)}, router_pid))
        flooded, peak_flood = asyncio.run(run_phase(
            base, {**quiet, "noisy": (tenant_keys["noisy"], 20 * SLOTS)}, router_pid))
        check_refusals(solo)
        check_refusals(flooded)
        solo.pop("noisy")
        noisy = flooded.pop("noisy")
        assert noisy.statuses[429] > 0 and noisy.ok > 0, noisy.statuses
        for tenant in QUIET:
            assert set(flooded[tenant].statuses) == {200}, (tenant, flooded[tenant].statuses)
            # goodput kept: the 19x beyond capacity costs a quiet tenant less than 60%. On 2
            # cores the flood's admissions and refusals take the router's and the engine's CPU
            # (measured: 9-12 requests per phase under the flood, 8 before issue 20); beside
            # the 1x tenant the engine's fair scheduler serves a quiet tenant's lone request
            # first (20-25 requests per phase, 14 before), so the ratio fell from 0.57 to 0.45
            assert flooded[tenant].ok >= 0.4 * solo[tenant].ok, (
                tenant, solo[tenant].ok, flooded[tenant].ok,
                statistics.median(solo[tenant].latencies_s),
                statistics.median(flooded[tenant].latencies_s))

        held = asyncio.run(leftovers(redis_url, (*QUIET, "noisy", "c", "d")))
        assert not held, held
        growth = max(peak_ten_x, peak_flood) - rss_start
        assert growth < 200, (rss_start, peak_ten_x, peak_flood)  # MB: bounded, not per request
        print(f"\noverload: router RSS {rss_start:.0f} MB, peak {rss_start + growth:.0f} MB; "
              f"10x {dict(sum((t.statuses for t in ten_x.values()), collections.Counter()))}; "
              f"quiet beside 1x {[solo[t].ok for t in QUIET]} vs beside 20x "
              f"{[flooded[t].ok for t in QUIET]} requests in {PHASE_S:.0f} s; "
              f"noisy {dict(noisy.statuses)}")
    finally:
        up.stop()
