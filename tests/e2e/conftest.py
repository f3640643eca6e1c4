"""One real cluster per test session: embedded Redis, local Ray, two model replicas of the
default model and two router replicas, on this machine's two cores."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.e2e.factories import E2ECluster, start_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    running = start_cluster(tmp_path_factory.mktemp("fairserve"))
    yield running
    running.stop()


@pytest.fixture
def e2e(cluster: E2ECluster) -> E2ECluster:
    """The session's cluster, with every request of the previous test ended."""
    asyncio.run(cluster.wait_idle())
    return cluster
