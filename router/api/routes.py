"""The OpenAI-compatible HTTP API: routes, SSE exactly as OpenAI streams, and the one place
where errors become OpenAI error bodies.

Streams: ``data: {chunk}`` lines, the first chat chunk carrying the role, the last one the
finish reason; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one
more chunk with empty ``choices`` carries the usage; then ``data: [DONE]``. An error after the
response has started is sent as ``data: {"error": ...}`` and the stream ends. Every message
but the openers carries an ``id:``, the id of the response-stream event it came from.

Resuming: a client that lost its stream asks for what followed the last id it saw, with the
``Last-Event-ID`` header (or ``starting_after``): on ``GET /v1/chat/completions/{id}?stream=true``
(``/v1/completions/{id}``; the id is ``X-Fairserve-Request-Id``), or by sending the request
again with the same ``Idempotency-Key``. Without ``stream``, the GET waits for the completion
and returns it. Only the tenant that made the request can read it (another key: 404).

A client that disconnects detaches: the request goes on for ``api.detach_grace_s`` (a client
may come back), then, with no reader, it is cancelled (queued: it leaves its queue, refunded;
running: the engine aborts it and frees its KV blocks). Ray Serve cancels the handler when the
HTTP client goes away; a streaming response's generator is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from redis.exceptions import OutOfMemoryError, RedisError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api import responses
from router.api.auth import ApiKey
from router.api.openai_models import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelList,
)
from router.api.openapi import openapi_document
from router.api.shaper import Shape, Shaper, sse_data
from router.api.tenant_gate import TenantGate
from router.dispatch.response_events import ChunkData, EndData
from router.dispatch.streams import START, ReadPoint
from router.errors import (
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RateLimitError,
    RouterError,
    StoreFullError,
    StreamIdleError,
    error_body,
)
from router.messages import Reader, ReaderKind
from router.service import EVENT_ID, IDEMPOTENCY_KEY_MAX_CHARS, RouterService
from router.state import keys
from router.state.api_keys import Principal
from router.telemetry.metrics import UNKNOWN_TENANT
from router.telemetry.request_observer import RequestObserver
from router.telemetry.tracing import ServerSpans

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in (
        (400, "invalid request (the offending field in error.param)"),
        (401, "missing, unknown or revoked API key"),
        (403, "the key's tenant is disabled"),
        (404, "unknown model"),
        (422, "an Idempotency-Key reused for a different request"),
        (413, "body too large, or the request alone exceeds a tenant limit"),
        (429, "quota reached or the tenant's queue is full (see Retry-After)"),
        (503, "Redis unreachable or the cluster is shedding load (see Retry-After)"),
    )
}


SSE: dict[str, Any] = {"text/event-stream": {}}  # its schema: openapi.py
RESUME_DESCRIPTION: dict[str, Any] = {
    "description": "the completion once it ends, or with stream=true its SSE stream after "
    "the given event (Last-Event-ID or starting_after; from the start without)",
    "content": SSE}

# the request's headers and path, as the document states them
EventId = Annotated[str | None, Header(pattern=EVENT_ID.pattern,
                                       description="the last event id seen")]
ResumeAfter = Annotated[str | None, Query(pattern=EVENT_ID.pattern,
                                          description="the last event id seen")]
RequestId = Annotated[str, Path(pattern=keys.REQUEST_ID_PATTERN.pattern,
                                description="X-Fairserve-Request-Id of the request")]
IdempotencyKey = Annotated[str | None, Header(
    min_length=1, max_length=IDEMPOTENCY_KEY_MAX_CHARS,
    description="a retry with the same key joins the request instead of running it twice")]
RepeatEventId = Annotated[str | None, Header(
    pattern=EVENT_ID.pattern, description="with a repeated Idempotency-Key: resume the "
    "stream after this event id")]



def build_api(service: RouterService) -> FastAPI:
    app = FastAPI(title="fairserve", version="0.1.0",
                  description="OpenAI-compatible API of a multi-tenant LLM serving cluster")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, service.deployment_limits())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimit, max_bytes=service.api.max_body_bytes)
    app.add_middleware(ServerSpans, tracing=service.tracing)  # sees every response but ...
    app.add_middleware(TenantGate, known=service.known_keys,  # ... the gate's, outermost
                       max_requests_per_tenant=service.api.max_requests_per_tenant)
    _add_error_handlers(app, service)

    @app.get("/health", summary="liveness")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Redis reachable and replicas (or scale-from-zero) available",
             responses={503: {"description": "not ready"}})
    async def ready() -> JSONResponse:
        state = await service.readiness()
        return JSONResponse(state, status_code=200 if state["ready"] else 503)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
    async def models(authorization: ApiKey) -> dict[str, Any]:
        """The base models (and their aliases) and the LoRA adapters this key's tenant may
        use, each with its context length; an alias's ``root`` is its model."""
        principal = await service.authenticate(authorization)
        return {"object": "list", "data": await service.model_cards(principal.tenant_id)}

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={
        **ERROR_RESPONSES, 200: {"description": "a completion, or with stream=true an SSE "
                                 "stream of chat.completion.chunk objects", "content": SSE}})
    async def chat_completions(
        body: ChatCompletionRequest,
        authorization: ApiKey,
        idempotency_key: IdempotencyKey = None,
        last_event_id: RepeatEventId = None,
    ) -> Any:
        return await _respond(service, body, authorization, idempotency_key, last_event_id)

    @app.get("/v1/chat/completions/{request_id}", response_model=ChatCompletion,
             summary="a chat completion by id: resume its stream, or wait for it",
             responses={**ERROR_RESPONSES, 200: RESUME_DESCRIPTION})
    async def chat_completion(
        request_id: RequestId, authorization: ApiKey, stream: bool = False,
        starting_after: ResumeAfter = None, last_event_id: EventId = None,
    ) -> Any:
        param = "starting_after" if starting_after else "Last-Event-ID"
        return await _resume(service, True, request_id, stream, starting_after or last_event_id,
                             param, authorization)

    @app.post("/v1/completions", response_model=Completion, responses={
        **ERROR_RESPONSES, 200: {"description": "a completion, or with stream=true an SSE "
                                 "stream of text_completion objects", "content": SSE}})
    async def completions(
        body: CompletionRequest,
        authorization: ApiKey,
        idempotency_key: IdempotencyKey = None,
        last_event_id: RepeatEventId = None,
    ) -> Any:
        return await _respond(service, body, authorization, idempotency_key, last_event_id)

    @app.get("/v1/completions/{request_id}", response_model=Completion,
             summary="a completion by id: resume its stream, or wait for it",
             responses={**ERROR_RESPONSES, 200: RESUME_DESCRIPTION})
    async def completion(
        request_id: RequestId, authorization: ApiKey, stream: bool = False,
        starting_after: ResumeAfter = None, last_event_id: EventId = None,
    ) -> Any:
        param = "starting_after" if starting_after else "Last-Event-ID"
        return await _resume(service, False, request_id, stream, starting_after or last_event_id,
                             param, authorization)

    responses.register(app, service, _raise_if_failed, ERROR_RESPONSES)
    return app


async def _respond(service: RouterService, body: ChatCompletionRequest | CompletionRequest,
                   authorization: str | None, idempotency_key: str | None,
                   last_event_id: str | None) -> Any:
    observer = RequestObserver(service.metrics, body)
    try:
        principal: Principal = await service.authenticate_to_submit(authorization, body,
                                                                    idempotency_key)
        observer.tenant = principal.tenant_id
        submission = await service.submit(principal, body, idempotency_key)
    except RouterError as exc:
        observer.refused(exc)
        raise
    reader = submission.reader  # attached: from here on it is let go whatever happens
    try:
        shape = (await service.shape_of(submission.tenant_id, submission.request_id)
                 if submission.is_duplicate else submission.shape)
        # a retry with the same key that says where it was resumes from there
        point = (await service.position(submission.tenant_id, submission.request_id,
                                        last_event_id, "Last-Event-ID")
                 if submission.is_duplicate and last_event_id else ReadPoint())
    except BaseException as exc:
        if isinstance(exc, RouterError):
            observer.refused(exc)
        await asyncio.shield(service.detach(reader))
        raise
    observer.admitted(submission.tenant_id, submission.request_id, submission.max_tokens)
    return await _reply(service, reader, shape, observer, body.stream, point,
                        submission.rate_limit_headers)


async def _reply(service: RouterService, reader: Reader, shape: Shape,
                 observer: RequestObserver, stream: bool, point: ReadPoint,
                 rate_limit_headers: dict[str, str] | None = None) -> Any:
    """The answer to an attached ``reader``, streamed or whole; the reader is detached when
    it ends, however it ends (``_ReaderStream`` for a stream)."""
    shaper = Shaper(shape, service.model_named(shape.base).tokenizer.piece)
    headers = {"X-Fairserve-Request-Id": shape.request_id, **(rate_limit_headers or {})}
    if stream:
        return _ReaderStream(service, reader,
                             _sse(service, reader.tenant_id, shaper, observer, point),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **headers})
    try:
        async for _, item in service.events(reader.tenant_id, shape.request_id, ReadPoint()):
            if isinstance(item, ChunkData):
                observer.tokens(item.num_tokens)
                shaper.add(item)
                continue
            phases = observer.ended(item)
            _raise_if_failed(item)
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


class _ReaderStream(StreamingResponse):
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


async def _resume(service: RouterService, is_chat: bool, request_id: str, stream: bool,
                  position: str | None, param: str, authorization: str | None) -> Any:
    """``GET /v1/chat/completions/{id}`` (and completions): the request, from ``position``."""
    observer = RequestObserver(service.metrics, None)
    try:
        principal: Principal = await service.authenticate(authorization)
        observer.tenant = principal.tenant_id
        shape = await service.shape_of(principal.tenant_id, request_id)
        if shape.is_chat != is_chat:
            raise NotFoundError(f"no such {'chat completion' if is_chat else 'completion'} "
                                f"{request_id!r}", param="request_id")
        point = (await service.position(principal.tenant_id, request_id, position, param)
                 if position else ReadPoint())
        reader = await service.attach(principal.tenant_id, request_id, ReaderKind.RESUME)
    except RouterError as exc:
        observer.refused(exc)
        raise
    return await _reply(service, reader, shape, observer, stream, point)


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


async def _sse(service: RouterService, tenant_id: str, shaper: Shaper,
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
            _raise_if_failed(item)
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
    finally:  # the reader is detached by _ReaderStream
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


def _raise_if_failed(end: EndData) -> None:
    if end.error is not None:
        error = RouterError(end.error.get("message", "the request failed"), end.error.get("param"))
        error.status = int(end.error.get("status", 500))
        error.type = end.error.get("type", "server_error")
        error.code = end.error.get("code")
        raise error
    if end.outcome == "dead":
        error = RouterError(f"the request could not be served ({end.reason})")
        error.code = "dead_lettered"
        raise error
    if end.outcome == "cancelled":
        error = RouterError(f"the request was cancelled ({end.reason})")
        error.status, error.code = 499, "cancelled"
        raise error


# ---- errors: the one place they become OpenAI bodies ----


def error_response(exc: RouterError) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))  # whole seconds, up
        if isinstance(exc, RateLimitError):
            headers["X-RateLimit-Reason"] = exc.reason
            headers.update(exc.headers())
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


def _add_error_handlers(app: FastAPI, service: RouterService) -> None:
    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        if exc.status >= 500:
            logger.error("request failed: %s", exc.message)
        return error_response(exc)

    @app.exception_handler(RedisError)
    async def _redis_down(_: Request, exc: RedisError) -> JSONResponse:
        # admission is one script: it ran whole or not at all. If the reply was lost after it
        # ran, a retry with the same Idempotency-Key joins the admitted request
        if isinstance(exc, OutOfMemoryError):
            return error_response(StoreFullError(str(exc)))
        logger.error("Redis unavailable: %s", exc)
        return error_response(OverloadedError(f"the queue store is unavailable: {exc}"))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's and FastAPI's own: no route (404), wrong method (405), a body that
        # cannot be read (400: not UTF-8, ...): OpenAI's error body all the same
        error = RouterError(str(exc.detail), code=_HTTP_CODES.get(exc.status_code))
        error.status = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path (Starlette names one route's)
            headers["Allow"] = ", ".join(_methods_of(app, request.url.path))
        return JSONResponse(error_body(error), status_code=exc.status_code,
                            headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # who asks comes first: without a valid key, 401 whatever else is wrong (as OpenAI)
        try:
            await service.authenticate(request.headers.get("authorization"))
        except RouterError as refused:
            return error_response(refused)
        except (RedisError, OSError):  # keys unreadable now: the 400 is still the answer
            logger.warning("Redis unavailable; answering the invalid request without its key")
        message, param = describe_validation_error(exc.errors())
        service.metrics.inc("fairserve_requests", (UNKNOWN_TENANT, "refused", "invalid_request_error"))
        return JSONResponse(error_body(InvalidRequestError(message, param)), status_code=400)


def _methods_of(app: FastAPI, path: str) -> list[str]:
    """The methods the routes of ``path`` take (one path may have a route per method)."""
    return sorted({method for route in app.routes if isinstance(route, APIRoute)
                   and route.path_regex.match(path) for method in route.methods or ()})


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """OpenAI-style message and ``param`` for the first pydantic error of a request."""
    first = list(errors)[0]
    where = [p for p in first.get("loc", ()) if p != "body"]
    if where and where[0] in ("header", "query", "path"):  # the name as the client sent it
        where = [_PARAMETER_NAMES.get(str(where[1]), where[1])] if len(where) > 1 else []
    # a union reports the branch it tried (str, list[int]); it is not part of the field path
    where = [p for p in where if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".") or None
    kind, message = first.get("type"), str(first.get("msg", "invalid"))
    if kind == "extra_forbidden":
        return f"unsupported field {param!r}: fairserve does not implement it", param
    if kind == "json_invalid":
        return "the body is not valid JSON", None
    if kind == "value_error" and message.startswith("Value error, "):
        field, _, text = message.removeprefix("Value error, ").partition(": ")
        return f"{field}: {text}", field
    if kind == "missing":
        return f"missing required field {param!r}", param
    return f"{param}: {message}" if param else message, param


_PARAMETER_NAMES = {"last-event-id": "Last-Event-ID", "idempotency-key": "Idempotency-Key"}
_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "TextPart"}


class BodyLimit:
    """Refuses bodies over ``max_bytes`` with 413: by Content-Length, or, for a body sent
    without one (chunked), as it comes in. The body is read whole before the app runs (it
    is at most ``max_bytes``), so no parser sees a cut one."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if is_replayed:
                return await receive()  # after the body: the disconnect, when it comes
            is_replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {
            "message": f"request body over {self.max_bytes} bytes", "type": "invalid_request_error",
            "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
