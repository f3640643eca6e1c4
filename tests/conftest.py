"""Suite-wide test setup: ``gpu`` tests are skipped cleanly on machines without CUDA; the
prepared-model cache is the session's own (the suite writes nothing under ``~/.cache`` and
always exercises the first, uncached load too)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_ENV = "FAIRSERVE_CACHE_DIR"


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(_CACHE_ENV):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="fairserve-test-cache-")
        config.stash[_OWN_CACHE] = os.environ[_CACHE_ENV]


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_CACHE, None)
    if own:
        shutil.rmtree(own, ignore_errors=True)


_OWN_CACHE = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # the marker, not the keyword: a test parametrized with "gpu" in its id is not one
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One real redis-server for the session, on a free port, with its own data directory."""
    from cluster.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    """A client of the session's server, flushed before each test."""
    client = redis_server.client(decode_responses=False)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redis_url(redis_client) -> str:
    """URL of the session's redis-server, flushed for this test."""
    kwargs = redis_client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"
