"""The embedded Redis's start script (the chart's StatefulSet) writes the password from its
mounted Secret into redis.conf quoted, so any one-line password works, a quote or a backslash
in it too (``printf 'requirepass "%s"'`` broke on both); a password of several lines is refused
at start, loudly. Run here with sh and the real redis-server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from cluster.ports import free_port
from cluster.redis_server import find_redis_server
from tests.helm.chart import of_kind, render, values_of

AUTH = {"redis": {"embedded": {"auth": {"enabled": True, "existingSecret": "managed-redis"}}}}


def start_script() -> str:
    (statefulset,) = of_kind(render(values_of(None, **AUTH)), "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    return container["args"][0]


def run_start(tmp_path: Path, password: str) -> tuple[subprocess.Popen[bytes], int]:
    """The chart's start script with this machine's paths: the Secret's file, /run/redis, and
    a redis.conf of our own that includes what it wrote."""
    (tmp_path / "secret").write_text(password)
    port = free_port()
    (tmp_path / "redis.conf").write_text(f'port {port}\nsave ""\ndir {tmp_path}\n'
                                         f"include {tmp_path}/auth.conf\n")
    script = (start_script().replace("/etc/redis-auth/password", str(tmp_path / "secret"))
              .replace("/run/redis/auth.conf", str(tmp_path / "auth.conf"))
              .replace("exec redis-server /etc/redis/redis.conf",
                       f"exec {find_redis_server()} {tmp_path}/redis.conf"))
    assert str(tmp_path) in script
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE), port


@pytest.mark.parametrize("password", ['plain-1234', 'quo"te', 'back\\slash', 'both\\"\\\\ "x',
                                      "spaces and 'single' $HOME `cmd`"])
def test_any_one_line_password_is_the_servers_password(tmp_path: Path, password: str) -> None:
    server, port = run_start(tmp_path, password + "\n")  # a Secret's file may end in a newline
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password=password + "x").ping()
    finally:
        server.kill()
        server.wait()


def test_a_password_of_several_lines_is_refused_at_start(tmp_path: Path) -> None:
    server, _ = run_start(tmp_path, "first\nsecond\n")
    assert server.wait(timeout=30) == 1
    assert b"one line" in (server.stderr.read() if server.stderr else b"")
