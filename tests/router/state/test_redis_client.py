"""The hiredis-packed connection sends exactly what redis-py would, and refuses what it refuses."""

from __future__ import annotations

import subprocess

import pytest
import redis.exceptions

from cluster.ports import free_port
from cluster.redis_server import EmbeddedRedis, find_redis_server
from router.state.redis_client import (
    PackedConnection,
    RedisNotReadyError,
    connect,
    loading_progress,
    wait_loaded,
)
from tests.cluster.factories import fill_redis
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


def test_loading_progress_reads_info_persistence() -> None:
    assert loading_progress({"loading": 0, "aof_enabled": 1}) is None
    assert loading_progress({"loading": 1, "loading_loaded_perc": 41.7,
                             "loading_eta_seconds": 3}) == "loading its data: 42% (3 s left)"


def test_wait_loaded_returns_once_a_restarted_server_has_replayed_its_aof(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path)
    server.start()
    fill_redis(server.client(), 40 * 1024 * 1024)
    num_keys = server.client().dbsize()
    server.stop()
    # a server that is not ours to wait for (as with --redis-url): started, not waited on
    process = subprocess.Popen(
        [find_redis_server(), "--port", str(server.port), "--bind", "127.0.0.1",
         "--dir", str(tmp_path), "--appendonly", "yes", "--save", "", "--logfile", "x.log"],
        stdin=subprocess.DEVNULL)
    try:
        lines: list[str] = []
        run(_wait_then_count(server.url, lines, num_keys))
        assert lines and all(line.startswith("redis: ") for line in lines)
    finally:
        process.kill()
        process.wait()


async def _wait_then_count(url: str, lines: list[str], num_keys: int) -> None:
    client = connect(url)
    try:
        await wait_loaded(client, timeout_s=60, progress=lines.append)
        assert await client.dbsize() == num_keys  # no LOADING error, every key there
    finally:
        await client.aclose()


def test_wait_loaded_gives_up_naming_what_it_saw() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    with pytest.raises(RedisNotReadyError, match="unreachable"):
        run(wait_loaded(client, timeout_s=0.5))


def test_the_password_comes_from_the_environment_or_a_mounted_file(tmp_path, monkeypatch) -> None:
    from router.state.redis_client import with_env_password, with_password

    assert with_password("redis://h:6379/0", "p@ss") == "redis://:p%40ss@h:6379/0"
    assert with_password("redis://u:own@h:6379/0", "other") == "redis://u:own@h:6379/0"
    assert with_password("rediss://default@h:6380/1", "p") == "rediss://default:p@h:6380/1"
    monkeypatch.delenv("FAIRSERVE_REDIS__PASSWORD", raising=False)
    monkeypatch.delenv("FAIRSERVE_REDIS__PASSWORD_FILE", raising=False)
    assert with_env_password("redis://h:6379/0") == "redis://h:6379/0"
    secret = tmp_path / "password"
    secret.write_text("from-a-file\n")  # as a Kubernetes Secret is mounted
    monkeypatch.setenv("FAIRSERVE_REDIS__PASSWORD_FILE", str(secret))
    assert with_env_password("redis://h:6379/0") == "redis://:from-a-file@h:6379/0"
    monkeypatch.setenv("FAIRSERVE_REDIS__PASSWORD", "from-env")  # the variable wins
    assert with_env_password("redis://h:6379/0") == "redis://:from-env@h:6379/0"
