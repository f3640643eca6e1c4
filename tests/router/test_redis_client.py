"""The hiredis-packed connection sends exactly what redis-py would, and refuses what it refuses."""

from __future__ import annotations

import pytest
import redis.exceptions

from router.redis_client import PackedConnection, connect
from tests.router.factories import run


def test_commands_round_trip_through_hiredis_packing(redis_url: str) -> None:
    run(_round_trip(redis_url))


async def _round_trip(redis_url: str) -> None:
    client = connect(redis_url)
    try:
        assert client.connection_pool.connection_class is PackedConnection
        values = ["plain", "ünïcode", "with space", "", "x" * 100_000]
        await client.rpush("packed", *values, 7, 2.5, b"\x00\xff")
        stored = await client.lrange("packed", 0, -1)
        assert stored == [v.encode() for v in values] + [b"7", b"2.5", b"\x00\xff"]
        # a command name with a literal argument goes out as two arguments
        assert "appendonly" in await client.config_get("appendonly")
    finally:
        await client.aclose()


def test_an_argument_redis_py_refuses_is_refused_the_same_way(redis_url: str) -> None:
    run(_refused(redis_url))


async def _refused(redis_url: str) -> None:
    client = connect(redis_url)
    try:
        with pytest.raises(redis.exceptions.DataError):
            await client.set("k", {"not": "encodable"})  # type: ignore[arg-type]
        assert await client.ping()  # the connection is still usable
    finally:
        await client.aclose()


def test_other_schemes_keep_redis_py_connections() -> None:
    client = connect("unix:///tmp/fairserve-no-such.sock")
    assert client.connection_pool.connection_class is not PackedConnection
