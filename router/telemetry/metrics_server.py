"""``GET /metrics`` on the operators' own port, never on the tenants' API port.

The exposition names every tenant, its queue and its token volume, so it is not served where
API keys are: each router listens on ``router.api.metrics_host``:``metrics_port`` (loopback by
default; the Helm chart opens it to its PodMonitor only). Every router of a machine binds the
same port (SO_REUSEPORT): any one of them answers, with the whole cluster's metrics
(``RouterService.metrics_exposition`` adds up every router's published counts). A plain
HTTP/1.1 responder: one request per connection, bounded reads, ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
READ_TIMEOUT_S = 10.0
MAX_HEADER_LINES = 100
MAX_LINE_BYTES = 8 * 1024


class MetricsServer:
    def __init__(self, exposition: Callable[[], Awaitable[bytes]], host: str, port: int) -> None:
        self.exposition = exposition
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; a port held by a process that is not a router of this machine is logged,
        and the router serves its clients without it."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                      reuse_port=True, limit=MAX_LINE_BYTES)
        except OSError as exc:
            logger.error("cannot serve /metrics on %s:%d: %s", self.host, self.port, exc)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body = await asyncio.wait_for(self._answer(reader), READ_TIMEOUT_S)
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: "
                         + (CONTENT_TYPE if status.startswith(b"200") else b"text/plain")
                         + b"\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass  # a client that sends nothing, too much, or goes away gets nothing
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        method, target, *_ = (await reader.readline()).split(b" ") + [b"", b""]
        for _ in range(MAX_HEADER_LINES):
            if (await reader.readline()) in (b"\r\n", b"\n", b""):
                break
        else:
            return b"431 Request Header Fields Too Large", b"too many header lines\n"
        if target.split(b"?", 1)[0] != b"/metrics":
            return b"404 Not Found", b"only /metrics is served here\n"
        if method != b"GET":
            return b"405 Method Not Allowed", b"GET /metrics\n"
        try:
            return b"200 OK", await self.exposition()
        except Exception as exc:  # Redis away: say so, the scraper records the failure
            logger.warning("/metrics failed: %s", exc)
            return b"503 Service Unavailable", f"metrics unavailable: {exc}\n".encode()
