"""A stream that goes idle: the SSE writer tells the client why (OpenAI's error body with
``stream_idle_timeout``, not "the queue store is unavailable") and detaches the request, so it
goes on for the grace period and a client may resume it, or it is cancelled then.

The service here is a stand-in of fairserve's own ``RouterService`` (only the calls the SSE
response makes), the response is run as its ASGI server would; the mux's timeout itself runs
on a real Redis in test_stream_mux.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from router.api.reply import reply
from router.api.shaper import Shape
from router.dispatch.response_events import ChunkData
from router.dispatch.streams import ReadPoint
from router.errors import StreamIdleError
from router.messages import Reader, ReaderKind
from router.telemetry.metrics import MetricsStore
from router.telemetry.request_observer import RequestObserver


class IdleService:
    def __init__(self) -> None:
        self.detached: list[Reader] = []
        self.tokenizer = SimpleNamespace(piece=str)

    def model_named(self, name: str) -> Any:
        return self

    async def event_batches(self, tenant_id: str, request_id: str, point: ReadPoint
                            ) -> AsyncIterator[list[tuple[str, Any]]]:
        yield [("1-0", ChunkData("Hi", 1, None, 0, None, [5], 1))]
        raise StreamIdleError(f"request {request_id!r} sent nothing for 600 s",
                              param="request_id")

    async def detach(self, reader: Reader) -> None:
        self.detached.append(reader)


def test_an_idle_stream_says_so_and_detaches() -> None:
    reader = Reader("acme", "chatcmpl-1", "r1", ReaderKind.STREAM)

    async def scenario() -> tuple[list[str], IdleService, MetricsStore]:
        service, metrics = IdleService(), MetricsStore()
        observer = RequestObserver(metrics, None)
        observer.tenant = "acme"
        response = await reply(service, reader,  # type: ignore[arg-type]
                               Shape("chatcmpl-1", True, "m", 1, 3), observer, True, ReadPoint())
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays
            return {}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        out = [m["body"].decode() for m in sent if m["type"] == "http.response.body"
               and m.get("body")]
        return out, service, metrics

    out, service, metrics = asyncio.run(scenario())
    assert '"content":"Hi"' in "".join(out)
    error = json.loads(out[-1].removeprefix("data: "))["error"]
    assert error["code"] == "stream_idle_timeout" and error["param"] == "request_id"
    assert "queue store" not in error["message"]
    assert service.detached == [reader]
    assert metrics.counters[("fairserve_requests", ("acme", "failed", "stream_idle_timeout"))] == 1
