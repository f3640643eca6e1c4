"""``/metrics`` (the whole cluster's, whichever router answers) and ``Server-Timing``."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.telemetry.metrics import SNAPSHOT_S
from tests.e2e.factories import MODEL, NUM_REPLICAS, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _scrape(e2e: E2ECluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(e2e.metrics_url, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_histograms_and_counters_move_as_requests_complete(e2e: E2ECluster) -> None:
    before = _scrape(e2e)
    num = 4
    client = e2e.client()
    for i in range(num):
        client.chat.completions.create(model=MODEL, max_tokens=6, extra_body={"min_tokens": 6},
                                       messages=[{"role": "user", "content": f"Hi {i}"}])
    time.sleep(SNAPSHOT_S + 0.5)  # every router has published its counts
    for _ in range(4):  # the two routers answer in turn: each one shows all requests
        after = _scrape(e2e)
        for name in ("fairserve_time_to_first_token_seconds_count",
                     "fairserve_queue_time_seconds_count", "fairserve_prefill_time_seconds_count",
                     "fairserve_decode_time_seconds_count",
                     "fairserve_e2e_request_latency_seconds_count"):
            assert _value(after, name, tenant="demo") - _value(before, name, tenant="demo") \
                >= num, name
        assert _value(after, "fairserve_requests_total", tenant="demo", outcome="completed",
                      reason="length") - _value(before, "fairserve_requests_total",
                                                tenant="demo", outcome="completed",
                                                reason="length") >= num
        assert _value(after, "fairserve_output_tokens_total", tenant="demo") - \
            _value(before, "fairserve_output_tokens_total", tenant="demo") >= 6 * num
        itl = "fairserve_inter_token_latency_seconds_count"
        assert _value(after, itl, tenant="demo") - _value(before, itl, tenant="demo") \
            >= 5 * num
        inf = _value(after, "fairserve_e2e_request_latency_seconds_bucket", tenant="demo",
                     le="+Inf")
        assert inf == _value(after, "fairserve_e2e_request_latency_seconds_count",
                             tenant="demo")
        assert _value(after, "fairserve_replicas") == NUM_REPLICAS
        kv_total = [v for (n, _), v in after.items() if n == "fairserve_replica_kv_blocks_total"]
        assert len(kv_total) == NUM_REPLICAS and all(v > 0 for v in kv_total)
        assert ("fairserve_queue_depth_requests", (("priority", "0"), ("tenant", "demo"))) \
            in after


def test_server_timing_says_where_the_time_went(e2e: E2ECluster) -> None:
    root = e2e.base_url.removesuffix("/v1")
    response = httpx.post(f"{root}/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {e2e.demo_key}"},
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8})
    assert response.status_code == 200
    timing = {}
    for part in response.headers["server-timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        timing[name] = float(dur)
    assert set(timing) == {"queue", "engine-queue", "prefill", "decode", "total"}
    assert all(v >= 0 for v in timing.values())
    assert timing["prefill"] > 0 and timing["decode"] > 0
    phases = timing["queue"] + timing["engine-queue"] + timing["prefill"] + timing["decode"]
    assert phases <= timing["total"] + 1
    usage = response.json()["usage"]
    assert usage["timings_ms"] == {"queue": timing["queue"],
                                   "engine_queue": timing["engine-queue"],
                                   "prefill": timing["prefill"], "decode": timing["decode"]}


def test_metrics_are_served_to_operators_not_on_the_tenants_port(e2e: E2ECluster) -> None:
    """The exposition names every tenant: it is on its own port, never the API's."""
    root = e2e.base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/metrics", timeout=30).status_code == 404
    assert httpx.get(f"{root}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {e2e.demo_key}"}).status_code == 404
    assert not e2e.metrics_url.startswith(root + "/")
    assert "fairserve_queue_depth" in httpx.get(e2e.metrics_url, timeout=30).text
