"""The metrics store: counts, histograms, snapshots merged across routers, the text format."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from replicas.protocol import ReplicaLoad
from router.messages import TenantBacklog
from router.state import keys, nodes
from router.state.nodes import NodeCounts
from router.state.redis_client import connect
from router.telemetry.metrics import (
    MAX_MODEL_LABELS,
    OTHER_MODEL,
    ClusterState,
    MetricsStore,
    exposition,
)
from router.telemetry.request_observer import PhaseTimes


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def _load(replica_id: str) -> ReplicaLoad:
    return ReplicaLoad(replica_id=replica_id, max_ongoing=8, ongoing=2, num_running=2,
                       num_waiting=1, num_free_kv_blocks=30, num_total_kv_blocks=100,
                       output_tokens_per_s=12.5, reported_ms=0)


def test_histogram_buckets_are_cumulative_and_snapshots_add_up() -> None:
    a, b = MetricsStore(), MetricsStore()
    for value in (0.003, 0.2, 7.0):
        a.observe("fairserve_queue_time_seconds", ("t1",), value)
    b.observe("fairserve_queue_time_seconds", ("t1",), 0.2, times=2)
    b.observe("fairserve_queue_time_seconds", ("t2",), 1000.0)
    a.inc("fairserve_requests", ("t1", "completed", "stop"))
    b.inc("fairserve_requests", ("t1", "completed", "stop"), 2)
    merged = a.merged([b.to_json(), b"not json"])
    state = ClusterState([TenantBacklog("t1", 0, 3, 450, 1)], [_load("r1"), _load("r2")])
    s = _samples(exposition(merged, state))

    def q(name: str, **labels: str) -> float:
        return s[(name, tuple(sorted(labels.items())))]

    h = "fairserve_queue_time_seconds"
    assert q(f"{h}_bucket", tenant="t1", le="0.005") == 1
    assert q(f"{h}_bucket", tenant="t1", le="0.25") == 4
    assert q(f"{h}_bucket", tenant="t1", le="5.0") == 4
    assert q(f"{h}_bucket", tenant="t1", le="+Inf") == q(f"{h}_count", tenant="t1") == 5
    assert q(f"{h}_sum", tenant="t1") == pytest.approx(0.003 + 0.2 * 3 + 7.0)
    assert q(f"{h}_bucket", tenant="t2", le="300.0") == 0
    assert q(f"{h}_bucket", tenant="t2", le="+Inf") == 1
    assert q("fairserve_requests_total", tenant="t1", outcome="completed", reason="stop") == 3
    assert q("fairserve_queue_depth_requests", tenant="t1", priority="0") == 3
    assert q("fairserve_queue_depth_tokens", tenant="t1", priority="0") == 450
    assert q("fairserve_requests_running", tenant="t1") == 1
    assert q("fairserve_replicas") == 2
    assert q("fairserve_replica_kv_blocks_used", replica="r2") == 70
    assert q("fairserve_replica_waiting", replica="r1") == 1
    # merging does not change the stores it read
    assert a.histograms[(h, ("t1",))].counts[-1] == 0


def test_a_snapshot_with_other_buckets_is_skipped() -> None:
    store = MetricsStore()
    raw = '{"c": [], "h": [["fairserve_queue_time_seconds", ["t"], [1, 2], 0.5]]}'
    assert store.merged([raw]).histograms == {}


def test_phase_times_and_server_timing() -> None:
    t = {"admitted_s": 10.0, "granted_s": 10.5, "arrived_s": 10.51, "first_scheduled_s": 10.52,
         "first_token_s": 10.72, "finished_s": 11.72}
    phases = PhaseTimes.from_timings(t)
    assert phases.as_ms() == {"queue": 500.0, "engine_queue": 10.0, "prefill": 200.0,
                              "decode": 1000.0}
    assert phases.server_timing(1.8) == ("queue;dur=500.0, engine-queue;dur=10.0, "
                                         "prefill;dur=200.0, decode;dur=1000.0, total;dur=1800.0")
    unserved = PhaseTimes.from_timings({"admitted_s": 1.0})
    assert unserved.as_ms() == {} and unserved.server_timing(0.25) == "total;dur=250.0"


def test_ray_nodes_count_alive_lost_and_removed_from_rays_table(redis_url) -> None:
    table = [{"NodeID": "a" * 56, "Alive": True, "NodeManagerHostname": "head"},
             {"NodeID": "b" * 56, "Alive": False, "DeathReason": 2,  # UNEXPECTED_TERMINATION
              "NodeManagerHostname": "worker-1"},
             {"NodeID": "c" * 56, "Alive": False, "DeathReason": 1,  # EXPECTED_TERMINATION
              "NodeManagerHostname": "worker-2"},
             {"NodeID": "d" * 56, "Alive": False, "DeathReason": 4,  # AUTOSCALER_DRAIN_IDLE
              "NodeManagerHostname": "worker-3"}]
    counts = NodeCounts.of_ray(table)
    assert (counts.alive, counts.lost, counts.removed) == (1, 1, 2)
    assert counts.summary() == f"1 alive, 1 lost, 2 removed (lost: worker-1 {'b' * 12})"
    s = _samples(exposition(MetricsStore(), ClusterState([], [], nodes=counts)))
    assert s[("fairserve_ray_nodes", (("state", "lost"),))] == 1
    assert s[("fairserve_ray_nodes", (("state", "removed"),))] == 2

    async def stored() -> NodeCounts | None:
        client = connect(redis_url)
        try:
            assert await nodes.read(client) is None
            await nodes.publish(client, counts)
            assert 0 < await client.ttl(keys.nodes()) <= nodes.TTL_S
            return await nodes.read(client)
        finally:
            await client.aclose()

    assert asyncio.run(stored()) == counts


def test_the_model_label_is_bounded() -> None:
    store = MetricsStore()
    labels = [store.model_label(f"adapter-{i}") for i in range(MAX_MODEL_LABELS + 5)]
    assert labels[:MAX_MODEL_LABELS] == [f"adapter-{i}" for i in range(MAX_MODEL_LABELS)]
    assert set(labels[MAX_MODEL_LABELS:]) == {OTHER_MODEL}
    assert store.model_label("adapter-3") == "adapter-3"  # one seen keeps its label
