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
from typing import Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api_keys import Principal
from router.errors import (
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RateLimitError,
    RouterError,
)
from router.metrics import UNKNOWN_TENANT
from router.openai_models import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelList,
)
from router.request_observer import RequestObserver
from router.response_events import ChunkData, EndData
from router.service import RouterService
from router.shaper import Shape, Shaper
from router.streams import START
from router.tracing import ServerSpans

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


RESUME_DESCRIPTION: dict[str, Any] = {
    "description": "the completion once it ends, or with stream=true its SSE stream after "
    "the given event (Last-Event-ID or starting_after; from the start without)"}


def build_api(service: RouterService) -> FastAPI:
    app = FastAPI(title="fairserve", version="0.1.0",
                  description="OpenAI-compatible API of a multi-tenant LLM serving cluster")
    app.add_middleware(BodyLimit, max_bytes=service.api.max_body_bytes)
    app.add_middleware(ServerSpans, tracing=service.tracing)  # outermost: sees every response
    _add_error_handlers(app, service)

    @app.get("/health", summary="liveness")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Redis reachable and replicas (or scale-from-zero) available",
             responses={503: {"description": "not ready"}})
    async def ready() -> JSONResponse:
        state = await service.readiness()
        return JSONResponse(state, status_code=200 if state["ready"] else 503)

    @app.get("/metrics", summary="Prometheus metrics of the whole cluster",
             response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(await service.metrics_exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        await service.authenticate(authorization)
        return {"object": "list", "data": [{
            "id": service.model.served_model_name, "object": "model",
            "created": service.model.created_s, "owned_by": "fairserve"}]}

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={
        **ERROR_RESPONSES, 200: {"description": "a completion, or with stream=true an SSE "
                                 "stream of chat.completion.chunk objects", "content": {
                                     "text/event-stream": {"schema": ChatCompletionChunk.model_json_schema()}}}})
    async def chat_completions(
        body: ChatCompletionRequest,
        authorization: str | None = Header(None),
        idempotency_key: str | None = Header(None),
        last_event_id: str | None = Header(None, description="with a repeated Idempotency-Key: "
                                           "resume the stream after this event id"),
    ) -> Any:
        return await _respond(service, body, authorization, idempotency_key, last_event_id)

    @app.get("/v1/chat/completions/{request_id}", response_model=ChatCompletion,
             summary="a chat completion by id: resume its stream, or wait for it",
             responses={**ERROR_RESPONSES, 200: RESUME_DESCRIPTION})
    async def chat_completion(
        request_id: str, stream: bool = False,
        starting_after: str | None = Query(None, description="the last event id seen"),
        authorization: str | None = Header(None),
        last_event_id: str | None = Header(None, description="the last event id seen"),
    ) -> Any:
        param = "starting_after" if starting_after else "Last-Event-ID"
        return await _resume(service, True, request_id, stream, starting_after or last_event_id,
                             param, authorization)

    @app.post("/v1/completions", response_model=Completion, responses={
        **ERROR_RESPONSES, 200: {"description": "a completion, or with stream=true an SSE "
                                 "stream of text_completion objects"}})
    async def completions(
        body: CompletionRequest,
        authorization: str | None = Header(None),
        idempotency_key: str | None = Header(None),
        last_event_id: str | None = Header(None, description="with a repeated Idempotency-Key: "
                                           "resume the stream after this event id"),
    ) -> Any:
        return await _respond(service, body, authorization, idempotency_key, last_event_id)

    @app.get("/v1/completions/{request_id}", response_model=Completion,
             summary="a completion by id: resume its stream, or wait for it",
             responses={**ERROR_RESPONSES, 200: RESUME_DESCRIPTION})
    async def completion(
        request_id: str, stream: bool = False,
        starting_after: str | None = Query(None, description="the last event id seen"),
        authorization: str | None = Header(None),
        last_event_id: str | None = Header(None, description="the last event id seen"),
    ) -> Any:
        param = "starting_after" if starting_after else "Last-Event-ID"
        return await _resume(service, False, request_id, stream, starting_after or last_event_id,
                             param, authorization)

    return app


async def _respond(service: RouterService, body: ChatCompletionRequest | CompletionRequest,
                   authorization: str | None, idempotency_key: str | None,
                   last_event_id: str | None) -> Any:
    observer = RequestObserver(service.metrics, body)
    try:
        principal: Principal = await service.authenticate(authorization)
        observer.tenant = principal.tenant_id
        submission = await service.submit(principal, body, idempotency_key)
        shape = (await service.shape_of(submission.tenant_id, submission.request_id)
                 if submission.is_duplicate else submission.shape)
        # a retry with the same key that says where it was resumes from there
        after = (await service.position(submission.tenant_id, submission.request_id,
                                        last_event_id, "Last-Event-ID")
                 if submission.is_duplicate and last_event_id else START)
    except RouterError as exc:
        observer.refused(exc)
        raise
    observer.admitted(submission.tenant_id, submission.request_id, submission.max_tokens)
    return await _reply(service, submission.tenant_id, shape, observer, body.stream, after)


async def _reply(service: RouterService, tenant_id: str, shape: Shape,
                 observer: RequestObserver, stream: bool, after: str) -> Any:
    shaper = Shaper(shape)
    headers = {"X-Fairserve-Request-Id": shape.request_id}
    await service.attach(tenant_id, shape.request_id)
    if stream:
        return StreamingResponse(_sse(service, tenant_id, shaper, observer, after),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    try:
        async for _, item in service.events(tenant_id, shape.request_id):
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
        await asyncio.shield(service.detach(tenant_id, shape.request_id))
        raise
    raise RouterError("the response stream ended without its terminal event")


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
        after = (await service.position(principal.tenant_id, request_id, position, param)
                 if position else START)
    except RouterError as exc:
        observer.refused(exc)
        raise
    return await _reply(service, principal.tenant_id, shape, observer, stream, after)


async def _sse(service: RouterService, tenant_id: str, shaper: Shaper,
               observer: RequestObserver, after: str) -> AsyncIterator[str]:
    request_id = shaper.id
    is_ended = False
    try:
        if after == START:  # a stream resumed part-way has had its openers
            for opener in shaper.first_chunks():
                yield _data(opener)
        async for event_id, item in service.events(tenant_id, request_id, after):
            if isinstance(item, ChunkData):
                observer.tokens(item.num_tokens)
                payload = shaper.delta(item)
                if payload is not None:
                    yield _data(payload, event_id)
                continue
            is_ended = True
            phases = observer.ended(item)
            _raise_if_failed(item)
            for payload in shaper.last_chunks(item, phases):
                yield _data(payload, event_id)
            yield f"id: {event_id}\ndata: [DONE]\n\n"
            return
    except RouterError as exc:
        is_ended = True
        yield _data(_error_body(exc))
    finally:
        if not is_ended:  # disconnect (or cancellation of this handler)
            observer.cancelled()
            await asyncio.shield(service.detach(tenant_id, request_id))


def _data(payload: dict[str, Any], event_id: str | None = None) -> str:
    data = f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
    return data if event_id is None else f"id: {event_id}\n{data}"


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


def _error_body(exc: RouterError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                      "code": exc.code}}


def error_response(exc: RouterError) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))  # whole seconds, up
        if isinstance(exc, RateLimitError):
            headers["X-RateLimit-Reason"] = exc.reason
    return JSONResponse(_error_body(exc), status_code=exc.status, headers=headers)


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
        logger.error("Redis unavailable: %s", exc)
        return error_response(OverloadedError(f"the queue store is unavailable: {exc}"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors())
        service.metrics.inc("fairserve_requests", (UNKNOWN_TENANT, "refused", "invalid_request_error"))
        return JSONResponse(_error_body(InvalidRequestError(message, param)), status_code=400)


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """OpenAI-style message and ``param`` for the first pydantic error of a request."""
    first = list(errors)[0]
    where = [p for p in first.get("loc", ()) if p != "body"]
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


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "TextPart"}


class BodyLimit:
    """Refuses bodies over ``max_bytes`` with 413, by Content-Length or as they stream in."""

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
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {
            "message": f"request body over {self.max_bytes} bytes", "type": "invalid_request_error",
            "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
