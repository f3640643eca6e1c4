"""One real cluster per test session: embedded Redis, local Ray, two model replicas of the
default model and two router replicas, on this machine's two cores. Tracing is on, exported
over OTLP/HTTP (the standard ``OTEL_*`` variables) to a receiver the session starts."""

from __future__ import annotations

import asyncio
import os

import pytest

from cluster.benchmarks.otlp_receiver import OtlpReceiver
from tests.e2e.factories import E2ECluster, start_cluster


@pytest.fixture(scope="session")
def otlp() -> OtlpReceiver:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver):
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    tracing_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                   "OTEL_BSP_SCHEDULE_DELAY": "200"}
    saved = {k: os.environ.get(k) for k in tracing_env}
    os.environ.update(tracing_env)
    try:
        running = start_cluster(tmp_path_factory.mktemp("fairserve"))
    finally:  # the deployments have their copy (cluster/app.py); keep this process untraced
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield running
    running.stop()


@pytest.fixture
def e2e(cluster: E2ECluster) -> E2ECluster:
    """The session's cluster, with every request of the previous test ended."""
    asyncio.run(cluster.wait_idle())
    return cluster
