"""The answer to an attached reader: the completion whole (JSON, with ``Server-Timing``) or
its SSE stream (``sse.py``), and the reader detached when it ends, however it ends.

A client that disconnects detaches: the request goes on for ``api.detach_grace_s`` (a client
may come back, ``resume.py``), then, with no reader, it is cancelled (queued: it leaves its
queue, refunded; running: the engine aborts it and frees its KV blocks). Ray Serve cancels the
handler when the HTTP client goes away; a streaming response's generator is closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.api.end_errors import raise_if_failed
from router.api.shaper import Shape, Shaper
from router.api.sse import sse_events
from router.dispatch.response_events import ChunkData
from router.dispatch.streams import ReadPoint
from router.errors import RouterError, StreamIdleError
from router.messages import Reader
from router.service import RouterService
from router.telemetry.request_observer import RequestObserver


async def reply(service: RouterService, reader: Reader, shape: Shape,
                observer: RequestObserver, stream: bool, point: ReadPoint,
                rate_limit_headers: dict[str, str] | None = None) -> Any:
    """The answer to an attached ``reader``, streamed or whole; the reader is detached when
    it ends, however it ends (``ReaderStream`` for a stream)."""
    shaper = Shaper(shape, service.model_named(shape.base).tokenizer.piece)
    headers = {"X-Fairserve-Request-Id": shape.request_id, **(rate_limit_headers or {})}
    if stream:
        return ReaderStream(service, reader,
                            sse_events(service, reader.tenant_id, shaper, observer, point),
                            media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", **headers})
    try:
        async for _, item in service.events(reader.tenant_id, shape.request_id, ReadPoint()):
            if isinstance(item, ChunkData):
                observer.tokens(item.num_tokens)
                shaper.add(item)
                continue
            phases = observer.ended(item)
            raise_if_failed(item)
            total_s = time.perf_counter() - observer.started_s
            return JSONResponse(shaper.final(item, phases), headers={
                **headers, "Server-Timing": phases.server_timing(total_s)})
    except asyncio.CancelledError:  # the client went away
        observer.cancelled()
        raise
    except StreamIdleError as exc:  # this reader gives up; the request goes on, detached
        observer.refused(exc)
        raise
    finally:
        await asyncio.shield(service.detach(reader))
    raise RouterError("the response stream ended without its terminal event")


class ReaderStream(StreamingResponse):
    """A streamed answer whose reader is detached when the response ends, however it ends: a
    generator that was never started (the client left first) never runs its own cleanup."""

    def __init__(self, service: RouterService, reader: Reader, content: AsyncIterator[str],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._service, self._reader = service, reader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._service.detach(self._reader))

