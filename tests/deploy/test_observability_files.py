"""The collector config and the Grafana dashboard in deploy/ agree with what fairserve emits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from replicas.protocol import ReplicaLoad
from router.messages import TenantBacklog
from router.telemetry.metrics import SPECS, ClusterState, MetricsStore, exposition

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _emitted_sample_names() -> set[str]:
    store = MetricsStore()
    for name, spec in SPECS.items():
        labels = tuple("x" for _ in spec.labels)
        if spec.buckets is None:
            store.inc(name, labels)
        else:
            store.observe(name, labels, 0.1)
    load = ReplicaLoad(replica_id="r", max_ongoing=1, ongoing=0, num_running=0, num_waiting=0,
                       num_free_kv_blocks=1, num_total_kv_blocks=1, output_tokens_per_s=0.0,
                       reported_ms=0)
    text = exposition(store, ClusterState([TenantBacklog("x", 0, 0, 0, 0)], [load])).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_dashboard_query_uses_metrics_fairserve_emits() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "fairserve-dashboard.json").read_text())
    emitted = _emitted_sample_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 10
    used = {name for e in exprs for name in re.findall(r"\bfairserve_[a-z0-9_]+", e)}
    assert used and used <= emitted, sorted(used - emitted)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in ("queue", "prefill", "decode", "time to first token", "inter-token", "backlog",
                 "replicas"):
        assert word in titles or any(word in t["legendFormat"] for p in dashboard["panels"]
                                     for t in p["targets"]), word
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_collector_pipelines_are_wired() -> None:
    config = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    scrape = config["receivers"]["prometheus"]["config"]["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics"}
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            for name in pipeline[kind]:
                assert name in config[kind], f"{kind} {name} is not defined"
    assert "otlp" in pipelines["traces"]["receivers"]
