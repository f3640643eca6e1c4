"""The OpenAI-compatible HTTP API: routes, SSE exactly as OpenAI streams, and the one place
where errors become OpenAI error bodies.

Streams: ``data: {chunk}`` lines, the first chat chunk carrying the role, the last one the
finish reason; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one
more chunk with empty ``choices`` carries the usage; then ``data: [DONE]``. An error after the
response has started is sent as ``data: {"error": ...}`` and the stream ends.

A client that disconnects cancels its request (queued: it leaves its queue and is refunded;
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

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api_keys import Principal
from router.errors import InvalidRequestError, OverloadedError, RateLimitError, RouterError
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
from router.request_observer import PhaseTimes, RequestObserver
from router.response_events import ChunkData, EndData
from router.service import RouterService, Submission
from router.tracing import ServerSpans

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in (
        (400, "invalid request (the offending field in error.param)"),
        (401, "missing, unknown or revoked API key"),
        (403, "the key's tenant is disabled"),
        (404, "unknown model"),
        (409, "an Idempotency-Key reused for a different request"),
        (413, "body too large, or the request alone exceeds a tenant limit"),
        (429, "quota reached or the tenant's queue is full (see Retry-After)"),
        (503, "Redis unreachable or the cluster is shedding load (see Retry-After)"),
    )
}


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
    ) -> Any:
        return await _respond(service, body, authorization, idempotency_key)

    @app.post("/v1/completions", response_model=Completion, responses={
        **ERROR_RESPONSES, 200: {"description": "a completion, or with stream=true an SSE "
                                 "stream of text_completion objects"}})
    async def completions(
        body: CompletionRequest,
        authorization: str | None = Header(None),
        idempotency_key: str | None = Header(None),
    ) -> Any:
        return await _respond(service, body, authorization, idempotency_key)

    return app


async def _respond(service: RouterService, body: ChatCompletionRequest | CompletionRequest,
                   authorization: str | None, idempotency_key: str | None) -> Any:
    observer = RequestObserver(service.metrics, body)
    try:
        principal: Principal = await service.authenticate(authorization)
        observer.tenant = principal.tenant_id
        submission = await service.submit(principal, body, idempotency_key)
    except RouterError as exc:
        observer.refused(exc)
        raise
    observer.admitted(submission.tenant_id, submission.request_id, submission.max_tokens)
    shaper = _Shaper(body, submission, service.model.served_model_name)
    if body.stream:
        return StreamingResponse(_sse(service, submission, shaper, observer),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Fairserve-Request-Id": submission.request_id})
    try:
        async for item in service.events(submission.tenant_id, submission.request_id):
            if isinstance(item, ChunkData):
                observer.tokens(item.num_tokens)
                shaper.add(item)
                continue
            phases = observer.ended(item)
            _raise_if_failed(item)
            total_s = time.perf_counter() - observer.started_s
            return JSONResponse(shaper.final(item, phases), headers={
                "X-Fairserve-Request-Id": submission.request_id,
                "Server-Timing": phases.server_timing(total_s)})
    except asyncio.CancelledError:  # the client went away
        observer.cancelled()
        await asyncio.shield(service.cancel(submission.tenant_id, submission.request_id))
        raise
    raise RouterError("the response stream ended without its terminal event")


async def _sse(service: RouterService, submission: Submission, shaper: _Shaper,
               observer: RequestObserver) -> AsyncIterator[str]:
    is_ended = False
    try:
        for opener in shaper.first_chunks():
            yield _data(opener)
        async for item in service.events(submission.tenant_id, submission.request_id):
            if isinstance(item, ChunkData):
                observer.tokens(item.num_tokens)
                for payload in shaper.deltas(item):
                    yield _data(payload)
                continue
            is_ended = True
            phases = observer.ended(item)
            _raise_if_failed(item)
            for payload in shaper.last_chunks(item, phases):
                yield _data(payload)
            yield "data: [DONE]\n\n"
            return
    except RouterError as exc:
        is_ended = True
        yield _data(_error_body(exc))
    finally:
        if not is_ended:  # disconnect (or cancellation of this handler)
            observer.cancelled()
            await asyncio.shield(service.cancel(submission.tenant_id, submission.request_id))


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


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


class _Shaper:
    """Builds OpenAI's chat or completions objects from response events, for ``n`` choices.

    Streams are OpenAI's: a chat stream opens each choice with its role; each chunk carries one
    choice (by ``index``); a choice's last chunk has its ``finish_reason``; with
    ``include_usage`` a last chunk with empty ``choices`` has the usage, and with vLLM's
    ``continuous_usage_stats`` every chunk has the usage so far.
    """

    def __init__(self, body: ChatCompletionRequest | CompletionRequest, submission: Submission,
                 model: str) -> None:
        self.is_chat = isinstance(body, ChatCompletionRequest)
        self.include_usage = body.include_usage
        self.continuous_usage = body.continuous_usage
        self.num_choices = body.n
        self.id = submission.request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = submission.prompt_tokens
        self.num_tokens = 0  # all choices together
        self.texts: list[list[str]] = [[] for _ in range(body.n)]
        self.logprobs: list[list[Any]] = [[] for _ in range(body.n)]
        self.finished: set[int] = set()
        self.wants_logprobs = bool(body.logprobs) if self.is_chat else body.logprobs is not None

    def _envelope(self, choices: list[dict[str, Any]], streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if self.is_chat \
            else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created,
                               "model": self.model, "choices": choices}
        if streaming and self.include_usage:
            out["usage"] = None if not self.continuous_usage else {
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.prompt_tokens + self.num_tokens}
        return out

    def _choice(self, index: int, text: str | None, logprobs: Any,
                finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.is_chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        return choice

    def add(self, chunk: ChunkData) -> None:
        self.num_tokens += chunk.num_tokens
        self.texts[chunk.index].append(chunk.text)
        if chunk.logprobs:
            self.logprobs[chunk.index].extend(chunk.logprobs)

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the role (as OpenAI's do); completions start
        with text."""
        if not self.is_chat:
            return []
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], True)
                for i in range(self.num_choices)]

    def deltas(self, chunk: ChunkData) -> list[dict[str, Any]]:
        index = chunk.index
        offset = sum(map(len, self.texts[index]))
        logprobs = self._logprobs(chunk.logprobs or [], offset) if self.wants_logprobs else None
        self.add(chunk)
        out = []
        if chunk.text or chunk.num_tokens:
            out.append(self._envelope([self._choice(index, chunk.text, logprobs, None)], True))
        if chunk.finish_reason is not None:
            out.append(self._finish_chunk(index, chunk.finish_reason))
        return out

    def _finish_chunk(self, index: int, reason: str | None) -> dict[str, Any]:
        self.finished.add(index)
        return self._envelope([self._choice(index, None, None, reason)], True)

    def last_chunks(self, end: EndData, phases: PhaseTimes) -> list[dict[str, Any]]:
        reasons = self._reasons(end)
        chunks = [self._finish_chunk(i, reasons[i]) for i in range(self.num_choices)
                  if i not in self.finished]
        if self.include_usage:
            usage = self._envelope([], True)
            usage["usage"] = _usage(end, phases)
            chunks.append(usage)
        return chunks

    def _reasons(self, end: EndData) -> list[str | None]:
        """Each choice's finish reason (one choice: the request's)."""
        if end.finish_reasons is not None:
            return list(end.finish_reasons)
        return [end.finish_reason] * self.num_choices

    def final(self, end: EndData, phases: PhaseTimes) -> dict[str, Any]:
        reasons = self._reasons(end)
        choices = []
        for i in range(self.num_choices):
            text = "".join(self.texts[i])
            logprobs = self._logprobs(self.logprobs[i], 0) if self.wants_logprobs else None
            choice: dict[str, Any] = {"index": i, "logprobs": logprobs,
                                      "finish_reason": reasons[i]}
            choice |= {"message": {"role": "assistant", "content": text}} if self.is_chat \
                else {"text": text}
            choices.append(choice)
        out = self._envelope(choices, False)
        out["usage"] = _usage(end, phases)
        return out

    def _logprobs(self, items: list[Any], offset: int) -> dict[str, Any]:
        if self.is_chat:
            return {"content": [{
                "token": tok, "logprob": lp, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())}
                                 for t, p in top]} for tok, lp, top in items]}
        offsets, position = [], offset
        for tok, _, _ in items:
            offsets.append(position)
            position += len(tok)
        return {"tokens": [tok for tok, _, _ in items],
                "token_logprobs": [lp for _, lp, _ in items],
                "top_logprobs": [dict(top) for _, _, top in items],
                "text_offset": offsets}


def _usage(end: EndData, phases: PhaseTimes) -> dict[str, Any]:
    """OpenAI's usage, plus ``timings_ms``: where the request's time went (queue,
    engine_queue, prefill, decode), as in the ``Server-Timing`` header."""
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
            "timings_ms": phases.as_ms()}


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
