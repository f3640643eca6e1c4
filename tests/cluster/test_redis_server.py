"""The embedded redis-server: starts, persists through its AOF, survives kill -9 with fsync always."""

from __future__ import annotations

import pytest

from cluster.redis_server import AppendFsync, EmbeddedRedis, RedisServerError, find_redis_server
from tests.cluster.factories import fill_redis


def test_binary_is_found() -> None:
    assert find_redis_server().endswith("redis-server")


def test_session_server_serves_streams_and_lua(redis_client) -> None:
    redis_client.xadd("s", {"a": "1"})
    assert redis_client.xlen("s") == 1
    assert redis_client.eval("return redis.call('INCRBY', KEYS[1], ARGV[1])", 1, "n", 5) == 5
    info = redis_client.info("persistence")
    assert info["aof_enabled"] == 1


def test_clean_stop_and_restart_keeps_data(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    server.client().rpush("q", *range(100))
    server.stop()
    assert (tmp_path / "appendonly.aof").exists()
    restarted = EmbeddedRedis(tmp_path, port=server.port).start()
    try:
        assert restarted.client().llen("q") == 100
    finally:
        restarted.stop()


def test_kill_9_with_fsync_always_loses_nothing(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path, appendfsync=AppendFsync.ALWAYS).start()
    client = server.client()
    for i in range(500):
        client.rpush("q", i)  # each acknowledged write is on disk before the reply
    server.kill()
    assert not server.is_running
    restarted = EmbeddedRedis(tmp_path, appendfsync=AppendFsync.ALWAYS).start()
    try:
        assert [int(x) for x in restarted.client().lrange("q", 0, -1)] == list(range(500))
    finally:
        restarted.stop()


def test_a_busy_port_is_a_clear_error(tmp_path, redis_server) -> None:
    with pytest.raises(RedisServerError, match="exited at start"):
        EmbeddedRedis(tmp_path, port=redis_server.port).start()


AOF_BYTES = 40 * 1024 * 1024  # "tens of MB of history": long enough to replay to be seen


def test_restart_on_a_large_aof_is_ready_only_once_loaded(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    client = server.client()
    assert fill_redis(client, AOF_BYTES) >= AOF_BYTES * 0.9
    num_keys = client.dbsize()
    server.stop()
    lines: list[str] = []
    restarted = EmbeddedRedis(tmp_path, port=server.port, progress=lines.append).start()
    try:
        client = restarted.client()
        # no LOADING error: start returned after the replay, not when INFO first answered
        assert client.info("persistence")["loading"] == 0
        assert client.dbsize() == num_keys
        assert client.hget("history:{t0}:0", "n") == b"0"
    finally:
        restarted.stop()


def test_a_relative_data_dir_is_made_absolute(tmp_path, monkeypatch) -> None:
    # redis-server changes into --dir before it opens --logfile: relative paths broke it
    monkeypatch.chdir(tmp_path)
    server = EmbeddedRedis("state/redis").start()
    try:
        assert server.data_dir == tmp_path / "state" / "redis"
        server.client().set("k", "v")
    finally:
        server.stop()
    assert (tmp_path / "state" / "redis" / "appendonly.aof").is_file()
    assert (tmp_path / "state" / "redis" / "redis.log").is_file()
