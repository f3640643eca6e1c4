"""A stream that goes idle: the SSE writer tells the client why (OpenAI's error body with
``stream_idle_timeout``, not "the queue store is unavailable") and detaches the request, so it
goes on for the grace period and a client may resume it, or it is cancelled then.

The service here is a stand-in of fairserve's own ``RouterService`` (only the two calls the
SSE writer makes); the mux's timeout itself runs on a real Redis in test_stream_mux.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from router.api.routes import _sse
from router.api.shaper import Shape, Shaper
from router.dispatch.response_events import ChunkData
from router.dispatch.streams import START
from router.errors import StreamIdleError
from router.telemetry.metrics import MetricsStore
from router.telemetry.request_observer import RequestObserver


class IdleService:
    def __init__(self) -> None:
        self.detached: list[tuple[str, str]] = []

    async def event_batches(self, tenant_id: str, request_id: str, after: str
                            ) -> AsyncIterator[list[tuple[str, Any]]]:
        yield [("1-0", ChunkData("Hi", 1, None, 0, None, [5], 1))]
        raise StreamIdleError(f"request {request_id!r} sent nothing for 600 s",
                              param="request_id")

    async def detach(self, tenant_id: str, request_id: str) -> None:
        self.detached.append((tenant_id, request_id))


def test_an_idle_stream_says_so_and_detaches() -> None:
    async def scenario() -> tuple[list[str], IdleService, MetricsStore]:
        service, metrics = IdleService(), MetricsStore()
        observer = RequestObserver(metrics, None)
        observer.tenant = "acme"
        shaper = Shaper(Shape("chatcmpl-1", True, "m", 1, 3), str)
        out = [part async for part in _sse(service, "acme", shaper, observer,  # type: ignore[arg-type]
                                           START)]
        return out, service, metrics

    out, service, metrics = asyncio.run(scenario())
    assert '"content":"Hi"' in "".join(out)
    error = json.loads(out[-1].removeprefix("data: "))["error"]
    assert error["code"] == "stream_idle_timeout" and error["param"] == "request_id"
    assert "queue store" not in error["message"]
    assert service.detached == [("acme", "chatcmpl-1")]
    assert metrics.counters[("fairserve_requests", ("acme", "failed", "stream_idle_timeout"))] == 1
