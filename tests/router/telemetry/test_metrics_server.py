"""The operators' /metrics port (router/telemetry/metrics_server.py): every router of a machine
binds it (SO_REUSEPORT) and any one answers; only GET /metrics is served; a failing exposition
is a 503, a client that sends nothing gets nothing and holds nothing."""

from __future__ import annotations

import asyncio
import socket

import httpx

from cluster.ports import free_port
from router.telemetry.metrics_server import MetricsServer


def test_routers_share_the_port_and_only_get_metrics_is_served() -> None:
    async def scenario() -> None:
        port = free_port()
        calls = {"a": 0, "b": 0}

        def exposition(name: str):
            async def exposed() -> bytes:
                calls[name] += 1
                return f"fairserve_up{{router=\"{name}\"}} 1\n".encode()
            return exposed

        servers = [MetricsServer(exposition(n), "127.0.0.1", port) for n in ("a", "b")]
        for server in servers:
            await server.start()
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(40):  # new connections: the kernel spreads them over both
                    reply = await client.get(f"http://127.0.0.1:{port}/metrics",
                                             headers={"Connection": "close"})
                    assert reply.status_code == 200
                    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
                    assert reply.text.startswith("fairserve_up{router=")
                assert calls["a"] + calls["b"] == 40 and min(calls.values()) > 0
                assert (await client.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 404
                assert (await client.post(f"http://127.0.0.1:{port}/metrics")).status_code == 405
                # a client that connects and sends nothing does not hold up the others
                idle = socket.create_connection(("127.0.0.1", port))
                assert (await client.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200
                idle.close()
        finally:
            for server in servers:
                await server.stop()

    asyncio.run(scenario())


def test_a_failing_exposition_is_a_503() -> None:
    async def scenario() -> None:
        async def broken() -> bytes:
            raise ConnectionError("Redis is away")

        port = free_port()
        server = MetricsServer(broken, "127.0.0.1", port)
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                reply = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert reply.status_code == 503 and "Redis is away" in reply.text
        finally:
            await server.stop()

    asyncio.run(scenario())
