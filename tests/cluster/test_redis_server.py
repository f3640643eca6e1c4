"""The embedded redis-server: starts, persists through its AOF, survives kill -9 with fsync always."""

from __future__ import annotations

import pytest

from cluster.redis_server import AppendFsync, EmbeddedRedis, RedisServerError, find_redis_server


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
