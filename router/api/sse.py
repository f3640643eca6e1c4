"""SSE exactly as OpenAI streams, from a request's response-stream events.

Streams: ``data: {chunk}`` lines, the first chat chunk carrying the role, the last one the
finish reason; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one
more chunk with empty ``choices`` carries the usage; then ``data: [DONE]``. An error after the
response has started is sent as ``data: {"error": ...}`` and the stream ends. Every message
but the openers carries an ``id:``, the id of the response-stream event it came from (a
client resumes after it: ``resume.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from router.api.end_errors import raise_if_failed
from router.api.shaper import Shaper, sse_data
from router.dispatch.response_events import ChunkData, EndData
from router.dispatch.streams import START, ReadPoint
from router.errors import OverloadedError, RouterError, StreamIdleError, error_body
from router.service import RouterService
from router.telemetry.request_observer import RequestObserver


async def _openers(service: RouterService, tenant_id: str, shaper: Shaper, point: ReadPoint
                   ) -> str:
    """What a stream starts with: each choice's role; a resumed one had them, and with tool
    calls its parser reads what the client had first, silently."""
    if point.after == START and not point.has_positions:
        return "".join(sse_data(opener) for opener in shaper.first_chunks())
    if shaper.calls:
        for chunk in await service.chunks_before(tenant_id, shaper.id, point):
            shaper.delta(chunk)
    return ""


async def sse_events(service: RouterService, tenant_id: str, shaper: Shaper,
                     observer: RequestObserver, point: ReadPoint) -> AsyncIterator[str]:
    request_id = shaper.id
    is_ended = False
    try:
        openers = await _openers(service, tenant_id, shaper, point)
        if openers:
            yield openers
        # all the events that arrived together go out in one write
        async for batch in service.event_batches(tenant_id, request_id, point):
            text, end = _chunks_text(batch, shaper, observer)
            if end is None:
                if text:
                    yield text
                continue
            event_id, item = end
            is_ended = True
            phases = observer.ended(item)
            if text:  # what came before a failure is still the client's
                yield text
            raise_if_failed(item)
            yield "".join([*(sse_data(payload, event_id)
                             for payload in shaper.last_chunks(item, phases)),
                           f"id: {event_id}\ndata: [DONE]\n\n"])
            return
    except StreamIdleError as exc:  # this reader gives up; the request goes on, detached
        observer.refused(exc)
        yield sse_data(error_body(exc))
    except RouterError as exc:
        is_ended = True
        yield sse_data(error_body(exc))
    except (RedisError, OSError) as exc:  # the queue store went away for good: say so
        is_ended = True
        yield sse_data(error_body(OverloadedError(f"the queue store is unavailable: {exc}")))
    finally:  # the reader is detached by ReaderStream (reply.py)
        if not is_ended:  # disconnect (or cancellation of this handler)
            observer.cancelled()


def _chunks_text(batch: list[tuple[str, ChunkData | EndData]], shaper: Shaper,
                 observer: RequestObserver) -> tuple[str, tuple[str, EndData] | None]:
    """The SSE text of a batch's token chunks, and its end event (id, event) if it has one."""
    out: list[str] = []
    for event_id, item in batch:
        if not isinstance(item, ChunkData):
            return "".join(out), (event_id, item)
        observer.tokens(item.num_tokens)
        out.append(shaper.delta_sse(item, event_id))
    return "".join(out), None
