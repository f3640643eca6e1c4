"""The OpenAI-compatible HTTP API's route table: the app (its middleware, error handlers and
document), health and readiness, models, chat completions and completions (``POST``, and
``GET`` by id to resume: ``resume.py``), and the Responses API (``responses/routes.py``).

A ``POST`` authenticates, admits and attaches a reader (``_respond``), then answers whole or as
SSE (``reply.py``, ``sse.py``); a repeated ``Idempotency-Key`` joins the request it names,
from ``Last-Event-ID`` when given. Errors become OpenAI bodies in ``error_handlers.py``.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import FastAPI, Header, Path, Query
from fastapi.responses import JSONResponse

from router.api.auth import ApiKey
from router.api.body_limit import BodyLimit
from router.api.error_handlers import add_error_handlers
from router.api.openai_models import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelList,
)
from router.api.openapi import openapi_document
from router.api.reply import reply
from router.api.responses.routes import register as register_responses
from router.api.resume import resume
from router.api.tenant_gate import TenantGate
from router.dispatch.streams import ReadPoint
from router.errors import RouterError
from router.service import EVENT_ID, IDEMPOTENCY_KEY_MAX_CHARS, RouterService
from router.state import keys
from router.state.api_keys import Principal
from router.telemetry.request_observer import RequestObserver
from router.telemetry.tracing import ServerSpans

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
    add_error_handlers(app, service)

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

    _chat_routes(app, service)
    _completion_routes(app, service)
    register_responses(app, service, ERROR_RESPONSES)
    return app


def _chat_routes(app: FastAPI, service: RouterService) -> None:
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
        return await resume(service, True, request_id, stream, starting_after or last_event_id,
                             param, authorization)


def _completion_routes(app: FastAPI, service: RouterService) -> None:
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
        return await resume(service, False, request_id, stream, starting_after or last_event_id,
                             param, authorization)


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
    return await reply(service, reader, shape, observer, body.stream, point,
                       submission.rate_limit_headers)
