"""Prometheus metrics of the whole cluster, served by any router on ``/metrics``.

NOTE: a scrape through the Ray Serve proxy lands on one router replica of several, so each
router's own counters and histograms (what it saw of the requests whose clients it held) are
not enough. Every router writes a snapshot of them to Redis every ``SNAPSHOT_S`` (expiring
after ``SNAPSHOT_TTL_S``), and ``/metrics`` adds up the live snapshots, this router's taken
fresh. The state of the cluster (backlog per tenant, replicas and their load) is read from
Redis at scrape time. A router that goes away takes its counts with it: Prometheus sees a
counter reset, which ``rate()`` handles.

Labels are bounded: ``tenant`` (the configured tenants; ``-`` before authentication),
``outcome`` and ``reason`` (fixed sets: outcomes, OpenAI error codes, finish reasons) and
``replica`` for the gauges of live replicas only.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from replicas.protocol import ReplicaLoad
from router.messages import TenantBacklog
from router.state import keys
from router.state.nodes import NodeCounts

logger = logging.getLogger(__name__)

SNAPSHOT_S = 2.0
SNAPSHOT_TTL_S = 30
MAX_MODEL_LABELS = 64  # distinct `model` label values per router (adapters may be thousands)
OTHER_MODEL = "other"
UNKNOWN_TENANT = "-"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0, 300.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # without the _total suffix of counters
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # None: a counter


SPECS = {spec.name: spec for spec in (
    MetricSpec("fairserve_requests", "requests by how they ended: completed, cancelled, "
               "refused (reason: the error code), failed", ("tenant", "outcome", "reason")),
    MetricSpec("fairserve_prompt_tokens", "prompt tokens of ended requests", ("tenant",)),
    MetricSpec("fairserve_cached_prompt_tokens", "prompt tokens of ended requests that the "
               "replica's prefix cache served (no prefill)", ("tenant",)),
    MetricSpec("fairserve_cached_prompt_tokens_per_request", "prompt tokens the prefix cache "
               "served, per ended request", ("tenant",), _TOKEN_BUCKETS),
    MetricSpec("fairserve_migrations", "requests moved to another replica mid-way, by why: "
               "replica_unavailable, stalled, stream_ended_early, redis_unavailable, stream_gap "
               "(router/dispatch/relay.py)",
               ("tenant", "reason")),
    MetricSpec("fairserve_output_tokens", "output tokens sent", ("tenant",)),
    MetricSpec("fairserve_model_requests", "requests admitted by the model they named: the "
               "base model or a LoRA adapter (the first MAX_MODEL_LABELS names a router sees, "
               "then `other`)", ("model",)),
    MetricSpec("fairserve_queue_time_seconds", "time in the tenant queue, admission to grant",
               ("tenant",), _LATENCY_BUCKETS_S),
    MetricSpec("fairserve_engine_queue_time_seconds", "time in the engine's waiting queue",
               ("tenant",), _LATENCY_BUCKETS_S),
    MetricSpec("fairserve_prefill_time_seconds", "first scheduled to first token",
               ("tenant",), _LATENCY_BUCKETS_S),
    MetricSpec("fairserve_decode_time_seconds", "first token to the last", ("tenant",),
               _E2E_BUCKETS_S),
    MetricSpec("fairserve_time_to_first_token_seconds", "request received to first token "
               "sent, as the router saw it", ("tenant",), _LATENCY_BUCKETS_S),
    MetricSpec("fairserve_inter_token_latency_seconds", "time between output tokens sent "
               "(one observation per token)", ("tenant",), _ITL_BUCKETS_S),
    MetricSpec("fairserve_e2e_request_latency_seconds", "request received to response end",
               ("tenant",), _E2E_BUCKETS_S),
)}


@dataclass(slots=True)
class _Histogram:
    counts: list[int]  # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0

    def add(self, other: _Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total


@dataclass(slots=True)
class MetricsStore:
    """One router's counters and histograms, by metric name and label values."""

    counters: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    histograms: dict[tuple[str, tuple[str, ...]], _Histogram] = field(default_factory=dict)
    models_labelled: set[str] = field(default_factory=set)

    def model_label(self, model: str) -> str:
        """``model`` as a label value, or ``other`` once ``MAX_MODEL_LABELS`` are in use."""
        seen = self.models_labelled
        if model in seen or len(seen) < MAX_MODEL_LABELS:
            seen.add(model)
            return model
        return OTHER_MODEL

    def inc(self, name: str, labels: tuple[str, ...], by: float = 1.0) -> None:
        key = (name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + by

    def observe(self, name: str, labels: tuple[str, ...], value: float, times: int = 1) -> None:
        buckets = SPECS[name].buckets
        assert buckets is not None, f"{name} is not a histogram"
        key = (name, labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = _Histogram([0] * (len(buckets) + 1))
        hist.counts[bisect.bisect_left(buckets, value)] += times
        hist.total += value * times

    def to_json(self) -> str:
        return json.dumps({
            "c": [[n, list(labels), v] for (n, labels), v in self.counters.items()],
            "h": [[n, list(labels), h.counts, h.total] for (n, labels), h in self.histograms.items()],
        }, separators=(",", ":"))

    def merge_json(self, raw: str | bytes) -> None:
        data = json.loads(raw)
        for name, labels, value in data.get("c", []):
            if name in SPECS:
                self.inc(name, tuple(labels), float(value))
        for name, labels, counts, total in data.get("h", []):
            spec = SPECS.get(name)
            if spec is None or spec.buckets is None or len(counts) != len(spec.buckets) + 1:
                continue  # written by a router of another version
            key = (name, tuple(labels))
            other = _Histogram([int(c) for c in counts], float(total))
            if key in self.histograms:
                self.histograms[key].add(other)
            else:
                self.histograms[key] = other

    def merged(self, others: Sequence[str | bytes]) -> MetricsStore:
        out = MetricsStore()
        out.merge_json(self.to_json())
        for raw in others:
            try:
                out.merge_json(raw)
            except (ValueError, TypeError) as exc:
                logger.warning("skipped a malformed metrics snapshot: %s", exc)
        return out

    def families(self) -> Iterator[Metric]:
        for name, spec in SPECS.items():
            if spec.buckets is None:
                counter = CounterMetricFamily(name, spec.help, labels=spec.labels)
                for (n, labels), value in sorted(self.counters.items()):
                    if n == name:
                        counter.add_metric(labels, value)
                yield counter
                continue
            hist = HistogramMetricFamily(name, spec.help, labels=spec.labels)
            for (n, labels), h in sorted(self.histograms.items()):
                if n != name:
                    continue
                cumulative, running = [], 0
                for bound, count in zip((*spec.buckets, float("inf")), h.counts, strict=True):
                    running += count
                    cumulative.append((_bound(bound), running))
                hist.add_metric(list(labels), cumulative, h.total)
            yield hist


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)


@dataclass(frozen=True, slots=True)
class ClusterState:
    backlog: list[TenantBacklog]
    replicas: list[ReplicaLoad]
    autoscaler: dict[str, Any] | None = None  # its last decision with inputs (cluster/autoscaling)
    scaling_decisions: dict[str, int] = field(default_factory=dict)  # by direction
    redis_memory: tuple[int, int] | None = None  # Redis's used_memory and maxmemory (0: none)
    nodes: NodeCounts | None = None  # Ray's nodes, as a router last saw them


def cluster_families(state: ClusterState) -> Iterator[Metric]:
    queued = GaugeMetricFamily("fairserve_queue_depth_requests", "requests waiting in the "
                               "tenant's queue", labels=("tenant", "priority"))
    tokens = GaugeMetricFamily("fairserve_queue_depth_tokens", "fair-share token cost of the "
                               "waiting requests (prompt + expected output)",
                               labels=("tenant", "priority"))
    leased = GaugeMetricFamily("fairserve_requests_running", "requests leased to a dispatcher",
                               labels=("tenant",))
    for b in state.backlog:
        queued.add_metric([b.tenant_id, str(b.priority)], b.num_queued)
        tokens.add_metric([b.tenant_id, str(b.priority)], b.queued_tokens)
        leased.add_metric([b.tenant_id], b.num_leased)
    yield from (queued, tokens, leased)
    yield GaugeMetricFamily("fairserve_replicas", "replicas with a live load report",
                            value=len(state.replicas))
    per_replica: dict[str, tuple[str, Any]] = {
        "fairserve_replica_running": ("requests the engine is running", "num_running"),
        "fairserve_replica_waiting": ("requests waiting in the engine", "num_waiting"),
        "fairserve_replica_ongoing": ("requests the replica holds", "ongoing"),
        "fairserve_replica_max_ongoing": ("the replica's slots", "max_ongoing"),
        "fairserve_replica_kv_blocks_total": ("KV cache blocks", "num_total_kv_blocks"),
        "fairserve_replica_output_tokens_per_second": ("output tokens/s over the last 10 s",
                                                       "output_tokens_per_s"),
    }
    for name, (text, attr) in per_replica.items():
        gauge = GaugeMetricFamily(name, text, labels=("replica",))
        for load in state.replicas:
            gauge.add_metric([load.replica_id], float(getattr(load, attr)))
        yield gauge
    used = GaugeMetricFamily("fairserve_replica_kv_blocks_used", "KV cache blocks in use",
                             labels=("replica",))
    for load in state.replicas:
        used.add_metric([load.replica_id], load.num_total_kv_blocks - load.num_free_kv_blocks)
    yield used
    if state.redis_memory is not None:
        used_bytes, max_bytes = state.redis_memory
        yield GaugeMetricFamily("fairserve_redis_used_memory_bytes", "memory Redis uses "
                                "(at its maxmemory new requests are refused: 503 store_full)",
                                value=used_bytes)
        yield GaugeMetricFamily("fairserve_redis_maxmemory_bytes", "Redis's maxmemory (0: none)",
                                value=max_bytes)
    if state.nodes is not None:
        ray_nodes = GaugeMetricFamily("fairserve_ray_nodes", "Ray nodes: alive, lost (died "
                                      "unasked: a crash, a pod or VM gone) and removed (on "
                                      "purpose)", labels=("state",))
        for name in ("alive", "lost", "removed"):
            ray_nodes.add_metric([name], getattr(state.nodes, name))
        yield ray_nodes
    yield from _autoscaler_families(state)


_AUTOSCALER_GAUGES = {
    "fairserve_autoscaler_target_replicas": ("replicas the autoscaler asks for", "decision_replicas"),
    "fairserve_autoscaler_desired_replicas": ("replicas the backlog wants, before the delays",
                                              "decision_desired"),
    "fairserve_autoscaler_queued_tokens": ("queued tokens the last decision saw", "queued_tokens"),
    "fairserve_autoscaler_inflight_tokens": ("tokens the replicas still had to process",
                                             "in_flight_tokens"),
    "fairserve_autoscaler_tokens_per_second_per_replica": ("throughput estimate per replica",
                                                           "decision_tokens_per_s"),
    "fairserve_autoscaler_drain_seconds": ("estimated drain time at the current target",
                                           "decision_drain_s"),
}


def _autoscaler_families(state: ClusterState) -> Iterator[Metric]:
    decisions = CounterMetricFamily("fairserve_autoscaler_decisions",
                                    "autoscaling decisions by direction (up, down, hold)",
                                    labels=("direction",))
    for direction, count in sorted(state.scaling_decisions.items()):
        decisions.add_metric([direction], count)
    yield decisions
    if state.autoscaler is None:
        return
    for name, (text, key) in _AUTOSCALER_GAUGES.items():
        value = state.autoscaler.get(key)
        if isinstance(value, int | float):
            yield GaugeMetricFamily(name, text, value=float(value))


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(store: MetricsStore, state: ClusterState) -> bytes:
    """The Prometheus text format of the merged store and the cluster's state."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*store.families(), *cluster_families(state)]))
    return generate_latest(registry)


async def autoscaler_state(client: Any) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """The autoscaler's last decision and its decision counts, as it wrote them to Redis."""
    raw = await client.get(keys.autoscaler())
    counts = await client.hgetall(keys.autoscaler_decisions())
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        record = None
    return (record if isinstance(record, dict) else None,
            {k.decode(): int(v) for k, v in counts.items()})
