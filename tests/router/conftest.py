from __future__ import annotations

import pytest


@pytest.fixture
def redis_url(redis_client) -> str:
    """URL of the session's redis-server, flushed for this test."""
    kwargs = redis_client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"
