"""The admin API's HTTP server in a router's process: uvicorn on a socket of its own, bound
with SO_REUSEPORT so the routers of one machine share ``router.api.admin_port`` (as /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


class AdminServer:
    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen; a port that cannot be bound is logged, and the router serves on without it."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            logger.error("cannot serve the admin API on %s:%d: %s", self.host, self.port, exc)
            return
        # log_config None: the router process's logging stays as it is
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        # NOTE: _serve, not serve: serve() takes SIGINT and SIGTERM for itself while it runs
        # (on the main thread), and the router's process must keep its own handlers
        self._task = asyncio.create_task(self._server._serve(sockets=[sock]), name="admin API")

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, timeout=5)
