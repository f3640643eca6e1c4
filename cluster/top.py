"""``fairserve top``: a live terminal view of the cluster, read from Redis.

Tenants: queued requests and tokens, running requests (from the queues and leases), output
tokens/s and p50/p99 queue time and TTFT over the last ``WINDOW_S`` (from the routers' metrics
snapshots: the histogram counts that grew in the window, quantiles interpolated inside their
bucket as Prometheus' ``histogram_quantile`` does). Replicas: running, waiting, KV blocks used,
output tokens/s (from their load reports).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from replicas.protocol import ReplicaLoad
from router.messages import TenantBacklog
from router.state import keys
from router.state.capacity import read_loads
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.telemetry.metrics import SPECS, MetricsStore, autoscaler_state

WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class Frame:
    at_s: float
    backlog: list[TenantBacklog]
    replicas: list[ReplicaLoad]
    metrics: MetricsStore
    autoscaler: dict[str, Any] | None = None


async def read_frame(client: aioredis.Redis) -> Frame:
    members = cast(set[bytes], await client.smembers(keys.metrics_routers()))
    holders = sorted(m.decode() for m in members)
    raws = await client.mget([keys.router_metrics(h) for h in holders]) if holders else []
    metrics = MetricsStore().merged([raw for raw in raws if raw is not None])
    backlog = await TenantQueues(Scripts(client)).backlog()
    decision, _ = await autoscaler_state(client)
    return Frame(time.monotonic(), backlog, await read_loads(client), metrics, decision)


def quantile(q: float, bounds: tuple[float, ...], counts: list[int]) -> float | None:
    """``histogram_quantile`` over non-cumulative bucket counts (the last one is +Inf)."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, count in enumerate(counts):
        if seen + count >= rank and count > 0:
            if i == len(bounds):  # +Inf: the highest finite bound is all we know
                return bounds[-1]
            low = bounds[i - 1] if i > 0 else 0.0
            return low + (bounds[i] - low) * (rank - seen) / count
        seen += count
    return bounds[-1]


def _grown(now: MetricsStore, then: MetricsStore, name: str, tenant: str) -> list[int]:
    key = (name, (tenant,))
    new = now.histograms.get(key)
    if new is None:
        return []
    old = then.histograms.get(key)
    return [a - (old.counts[i] if old else 0) for i, a in enumerate(new.counts)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def render(now: Frame, then: Frame) -> Group:
    span_s = max(now.at_s - then.at_s, 1e-9)
    tenants = Table(title="tenants", title_justify="left", expand=True)
    for column in ("tenant", "prio", "queued", "queued tok", "running", "out tok/s",
                   "queue p50 ms", "queue p99 ms", "TTFT p50 ms", "TTFT p99 ms"):
        tenants.add_column(column, justify="left" if column == "tenant" else "right")
    for b in sorted(now.backlog, key=lambda x: (-x.priority, x.tenant_id)):
        key = ("fairserve_output_tokens", (b.tenant_id,))
        rate = (now.metrics.counters.get(key, 0.0) - then.metrics.counters.get(key, 0.0)) / span_s
        cells = [b.tenant_id, str(b.priority), str(b.num_queued), str(b.queued_tokens),
                 str(b.num_leased), f"{max(rate, 0.0):.1f}"]
        for name in ("fairserve_queue_time_seconds", "fairserve_time_to_first_token_seconds"):
            bounds = SPECS[name].buckets or ()
            counts = _grown(now.metrics, then.metrics, name, b.tenant_id)
            cells += [_ms(quantile(0.5, bounds, counts)), _ms(quantile(0.99, bounds, counts))]
        tenants.add_row(*cells)
    title = f"replicas: {len(now.replicas)}"
    if now.autoscaler is not None:
        title += (f"   autoscaler target {now.autoscaler.get('decision_replicas')} "
                  f"({now.autoscaler.get('decision_reason')})")
    replicas = Table(title=title, title_justify="left", expand=True)
    for column in ("replica", "slots", "ongoing", "running", "waiting", "KV used", "out tok/s",
                   "adapters"):
        replicas.add_column(column, justify="left" if column in ("replica", "adapters")
                            else "right")
    for r in sorted(now.replicas, key=lambda x: x.replica_id):
        used = r.num_total_kv_blocks - r.num_free_kv_blocks
        share = used / r.num_total_kv_blocks if r.num_total_kv_blocks else 0.0
        replicas.add_row(r.replica_id, str(r.max_ongoing), str(r.ongoing), str(r.num_running),
                         str(r.num_waiting), f"{used}/{r.num_total_kv_blocks} ({share:.0%})",
                         f"{r.output_tokens_per_s:.1f}", ", ".join(r.adapters) or "-")
    return Group(tenants, replicas)


async def run_top(redis_url: str, interval_s: float, once: bool,
                  console: Console | None = None) -> int:
    console = console or Console()
    client = connect(redis_url, socket_timeout=5)
    try:
        history: deque[Frame] = deque([await read_frame(client)])
        if once:
            await asyncio.sleep(interval_s)
            console.print(render(await read_frame(client), history[0]))
            return 0
        with Live(render(history[0], history[0]), console=console, screen=False,
                  auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval_s)
                frame = await read_frame(client)
                while len(history) > 1 and frame.at_s - history[1].at_s >= WINDOW_S:
                    history.popleft()
                live.update(render(frame, history[0]), refresh=True)
                history.append(frame)
    except KeyboardInterrupt:
        return 0
    finally:
        await client.aclose()
