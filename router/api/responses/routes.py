"""The Responses API's routes: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``.

A response is admitted, queued, fair-shared, metered and traced as the chat completion it runs
as (``chat.py``); the answer goes back whole (``output.py``) or as the typed stream events
(``stream_events.py``). With ``store`` (the default) the response and its conversation are
kept (``router/state/responses.py``), so any router serves the next turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Path
from fastapi.responses import JSONResponse, StreamingResponse

from router.api.auth import ApiKey
from router.api.end_errors import raise_if_failed
from router.api.responses import ResponsesRequest
from router.api.responses.chat import chat_request
from router.api.responses.objects import ResponseDeleted, ResponseObject
from router.api.responses.output import finished, response_id, response_skeleton
from router.api.responses.stream_events import StreamEvents
from router.api.shaper import Shaper
from router.dispatch.response_events import ChunkData, EndData
from router.dispatch.streams import ReadPoint
from router.errors import (
    CONVERSATION_TOO_LARGE,
    PREVIOUS_RESPONSE_NOT_FOUND,
    InvalidRequestError,
    NotFoundError,
    RouterError,
)
from router.state.keys import RESPONSE_ID_PATTERN
from router.state.responses import StoredResponse
from router.telemetry.request_observer import RequestObserver

ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN.pattern, description="resp_...")]


def register(app: FastAPI, service: Any, errors: dict[int | str, dict[str, Any]]
             ) -> None:
    """The Responses routes on ``app`` (``router/api/routes.py`` builds it, and hands it the
    error statuses it documents)."""
    found: dict[int | str, dict[str, Any]] = {k: v for k, v in errors.items()
                                              if k in (400, 401, 503)}
    sse: dict[str, Any] = {"text/event-stream": {}}

    @app.post("/v1/responses", response_model=ResponseObject, responses={
        **errors, 200: {"description": "the response, or with stream=true an SSE stream of "
                        "its events (response.created ... response.completed)",
                        "content": sse}})
    async def create_response(body: ResponsesRequest, authorization: ApiKey) -> Any:
        """Create a response (OpenAI's Responses API), stored unless ``store`` is false."""
        return await _create(service, body, authorization)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses={
        **found, 404: {"model": errors[404]["model"], "description": "no such response of "
                       "this tenant (never stored, expired, deleted, or another's)"}})
    async def get_response(response_id: ResponseId, authorization: ApiKey) -> Any:
        """A stored response."""
        principal = await service.authenticate(authorization)
        stored = await service.responses.get(principal.tenant_id, response_id)
        if stored is None:
            raise NotFoundError(f"no response {response_id!r}", param="response_id")
        return JSONResponse(stored.response)

    @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses={
        **found, 404: {"model": errors[404]["model"], "description": "no such response of "
                       "this tenant"}})
    async def delete_response(response_id: ResponseId, authorization: ApiKey) -> Any:
        """Delete a stored response (its conversation with it)."""
        principal = await service.authenticate(authorization)
        if not RESPONSE_ID_PATTERN.match(response_id) or \
                not await service.responses.delete(principal.tenant_id, response_id):
            raise NotFoundError(f"no response {response_id!r}", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}


async def _history(service: Any, tenant_id: str, body: ResponsesRequest
                   ) -> list[dict[str, Any]]:
    """The conversation of ``previous_response_id`` (none without one)."""
    if body.previous_response_id is None:
        return []
    previous = await service.responses.get(tenant_id, body.previous_response_id)
    if previous is None:
        raise InvalidRequestError(
            f"previous_response_id: no response {body.previous_response_id!r} (it expired, "
            "was deleted, or is not yours)", param="previous_response_id",
            code=PREVIOUS_RESPONSE_NOT_FOUND)
    return previous.messages


async def _create(service: Any, body: ResponsesRequest, authorization: str | None
                  ) -> Any:
    principal = await service.authenticate(authorization, for_admission=True)
    store = service.responses
    history = await _history(service, principal.tenant_id, body)
    chat = chat_request(body, history)
    size = len(json.dumps(chat.model_dump(include={"messages"})["messages"]))
    if size > store.settings.max_bytes:
        raise InvalidRequestError(
            f"input: the conversation is {size} bytes as JSON; at most "
            f"{store.settings.max_bytes} are carried from turn to turn",
            param="previous_response_id" if history else "input", code=CONVERSATION_TOO_LARGE)
    observer = RequestObserver(service.metrics, chat)
    observer.tenant = principal.tenant_id
    try:
        submission = await service.submit(principal, chat, None)
    except RouterError as exc:
        observer.refused(exc)
        raise
    observer.admitted(submission.tenant_id, submission.request_id, submission.max_tokens)
    skeleton = response_skeleton(body, response_id(submission.request_id), int(time.time()),
                         "in_progress")
    shaper = Shaper(submission.shape, service.model_named(submission.shape.base).tokenizer.piece)
    # the conversation carried on: not the instructions (they are this turn's alone)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages[
        1 if body.instructions else 0:]]

    async def save(response: dict[str, Any], kept: dict[str, Any]) -> None:
        if body.store is not False:
            await store.put(principal.tenant_id, StoredResponse(response, [*messages, kept]))

    if body.stream:
        return StreamingResponse(
            _stream(service, submission, shaper, skeleton, observer, save),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **submission.rate_limit_headers})
    try:
        async for item, _, phases in _answer(service, submission, shaper, observer):
            if isinstance(item, EndData):
                raise_if_failed(item)
                response, kept = finished(skeleton, shaper.final(item, phases), item)
                await save(response, kept)
                return JSONResponse(response, headers=submission.rate_limit_headers)
    finally:
        await service.detach(submission.reader)
    raise RouterError("the response stream ended without its terminal event")


async def _answer(service: Any, submission: Any, shaper: Shaper, observer: RequestObserver
                  ) -> AsyncIterator[tuple[ChunkData | EndData, dict[str, Any] | None, Any]]:
    """The answer's events: each token chunk taken by the shaper, with its stream delta (None:
    nothing to send), then the end with the request's phases."""
    async for _, item in service.events(submission.tenant_id, submission.request_id,
                                        ReadPoint()):
        if isinstance(item, ChunkData):
            observer.tokens(item.num_tokens)
            shaper.add(item)
            payload = shaper.delta(item)
            yield item, (payload["choices"][0]["delta"]
                         if payload is not None and payload["choices"] else None), None
            continue
        yield item, None, observer.ended(item)
        return


async def _stream(service: Any, submission: Any, shaper: Shaper, skeleton: dict[str, Any],
                  observer: RequestObserver, save: Any) -> AsyncIterator[str]:
    events = StreamEvents(skeleton)
    yield events.opening()
    try:
        async for item, delta, phases in _answer(service, submission, shaper, observer):
            if isinstance(item, ChunkData):
                text = events.delta(delta) if delta is not None else ""
                if text:
                    yield text
                continue
            try:
                raise_if_failed(item)
            except RouterError as exc:
                yield events.failed(exc)
                return
            rest = shaper.last_chunks(item, phases)
            for chunk in rest:
                for choice in chunk.get("choices") or []:
                    text = events.delta(choice.get("delta") or {})
                    if text:
                        yield text
            response, kept = finished(skeleton, shaper.final(item, phases), item)
            await save(response, kept)
            yield events.closing(response)
            return
    finally:
        await service.detach(submission.reader)
