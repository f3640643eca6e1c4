"""``fairserve top``: quantiles from histogram buckets, and one frame read from a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from cluster.top import quantile, run_top
from router.state import keys
from router.state.tenants import Tenant
from router.telemetry.metrics import MetricsStore
from tests.router.factories import add_tenants, harness, make_request, run


def test_quantile_interpolates_inside_the_bucket() -> None:
    bounds = (0.1, 0.5, 1.0)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 0, 0, 0]) == pytest.approx(0.05)
    assert quantile(0.5, bounds, [0, 4, 0, 0]) == pytest.approx(0.3)
    assert quantile(0.99, bounds, [0, 0, 0, 3]) == 1.0  # in +Inf: the highest bound


def test_one_frame_shows_tenants_rates_and_latencies(redis_server, redis_client) -> None:
    async def scenario() -> str:
        async with harness(redis_server.url) as h:
            await add_tenants(h, Tenant(id="alpha"), Tenant(id="beta", priority=2))
            await h.queues.admit(make_request("alpha", "r1", prompt_tokens=10, max_tokens=20))
            store = MetricsStore()
            await h.client.sadd(keys.metrics_routers(), "router-1")

            async def publish() -> None:
                await h.client.set(keys.router_metrics("router-1"), store.to_json())

            await publish()
            console = Console(record=True, width=160)
            top = asyncio.create_task(run_top(redis_server.url, 0.5, once=True, console=console))
            await asyncio.sleep(0.1)
            store.inc("fairserve_output_tokens", ("beta",), 50)  # grows while top watches
            for _ in range(10):
                store.observe("fairserve_time_to_first_token_seconds", ("beta",), 0.2)
            await publish()
            assert await top == 0
            return console.export_text()

    text = run(scenario())
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells:
            rows[cells[0]] = cells
    assert "tenants" in text and "replicas: 0" in text
    # tenant, prio, queued, queued tok, running, out tok/s, queue p50/p99, TTFT p50/p99
    assert rows["alpha"] == ["alpha", "0", "1", "30", "0", "0.0", "-", "-", "-", "-"]
    beta = rows["beta"]
    assert beta[:5] == ["beta", "2", "0", "0", "0"] and float(beta[5]) > 0
    assert 100 < float(beta[8]) <= 250 and beta[6] == "-"  # 0.2 s lies in (0.1, 0.25]
