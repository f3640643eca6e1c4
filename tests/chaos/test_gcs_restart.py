"""The Ray GCS killed and restarted under 16 streams, with GCS fault tolerance: the GCS keeps
its tables in the Redis fairserve uses (``RAY_REDIS_ADDRESS``, what KubeRay's
``gcsFaultToleranceOptions`` and the chart's ``gcs-ft`` profile set), on a Ray cluster this test
starts (``ray.cluster_utils.Cluster``, as Ray's own GCS fault-tolerance tests do) and
``fairserve up`` joins. Goals: the streams go on while the GCS is away (the data path does not
touch it: router and replicas talk to each other and to Redis directly), every text equals the
uninterrupted run; after the restart Serve's applications are still there and serve a new
request; what Ray does not guarantee while the GCS is down (a new request needs no GCS, but a
replica that dies then cannot be replaced) is measured and printed."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray.cluster_utils import Cluster

from cluster.ports import free_port
from cluster.redis_server import EmbeddedRedis
from tests.chaos.factories import (
    StreamResult,
    assert_exact,
    start,
    stream_chat,
    unstreamed,
    wait_for_tokens,
)
from tests.chaos.test_migration import MAX_TOKENS, bodies, references, settings

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

GCS_DOWN_S = 5.0


async def restart_gcs_under_load(base: str, key: str, cluster: Cluster
                                 ) -> tuple[list[StreamResult], httpx.Response, float]:
    results = [StreamResult() for _ in bodies()]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        await asyncio.to_thread(cluster.head_node.kill_gcs_server)
        chars = sum(len(r.text) for r in results)
        # a new request while there is no GCS
        during = await client.post(f"{base}/chat/completions", timeout=120,
                                   headers={"Authorization": f"Bearer {key}"},
                                   json={**unstreamed(bodies()[1]), "max_tokens": 4})
        await asyncio.sleep(max(0.0, GCS_DOWN_S))
        flowed = sum(len(r.text) for r in results) - chars
        await asyncio.to_thread(cluster.head_node.start_gcs_server)
        started = time.monotonic()
        await asyncio.gather(*tasks)
        print(f"\nGCS down {GCS_DOWN_S:g} s: {flowed} characters streamed meanwhile; "
              f"a request sent then: HTTP {during.status_code}; the streams ended "
              f"{time.monotonic() - started:.1f} s after the restart")
    return results, during, float(flowed)


def test_a_gcs_restart_under_streams_breaks_none(tmp_path, monkeypatch) -> None:
    redis_server = EmbeddedRedis(tmp_path / "redis").start()
    monkeypatch.setenv("RAY_REDIS_ADDRESS", f"127.0.0.1:{redis_server.port}")
    cluster = None
    up = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "gcs_server_port": free_port()})
        config = settings(2)
        config["router"].update({"ingress": "proxy", "proxy_location": "HeadOnly"})
        config["ray"] = {"address": cluster.address}
        config["redis"] = {"url": redis_server.url}
        up, base, key, _ = start(tmp_path, config)
        expected = asyncio.run(references(base, key))
        results, during, flowed = asyncio.run(restart_gcs_under_load(base, key, cluster))
        assert_exact(results, expected, MAX_TOKENS)
        assert flowed > 0, "the streams stopped while the GCS was away"
        assert during.status_code == 200, during.text
        # Serve's application survived: it serves a new request, and the status sees it
        after = httpx.post(f"{base}/chat/completions", timeout=300,
                           headers={"Authorization": f"Bearer {key}"},
                           json=unstreamed(bodies()[0]))
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["message"]["content"] == expected[0]
    finally:
        if up is not None:
            up.stop()
        if cluster is not None:
            cluster.shutdown()
        redis_server.stop()
