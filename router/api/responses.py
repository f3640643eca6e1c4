"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: its ``instructions``, the conversation of its
``previous_response_id`` (stored in Redis: ``router/state/responses.py``) and its ``input``
items become chat messages (a ``function_call`` item an assistant message with
``tool_calls``, a ``function_call_output`` a ``tool`` message), its function tools chat tools,
and it is admitted, queued, fair-shared, metered and traced as any chat completion. The
answer comes back as output items (a ``message`` with ``output_text``, ``function_call``s),
whole or as the typed stream events the SDK reads (``response.created``, ...,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``). With ``store`` (the default) the response and its conversation are
kept, so any router serves the next turn.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Path
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.api.auth import ApiKey
from router.api.openai_models import (
    MAX_TOOLS,
    REQUIRED_NEEDS_TOOLS,
    TOOL_NAME,
    ChatCompletionRequest,
    _state_rules,
)
from router.api.shaper import Shaper
from router.dispatch.response_events import ChunkData, EndData
from router.dispatch.streams import ReadPoint
from router.errors import (
    CONVERSATION_TOO_LARGE,
    PREVIOUS_RESPONSE_NOT_FOUND,
    TOOL_REFERENCE,
    InvalidRequestError,
    NotFoundError,
    RouterError,
)
from router.state.keys import RESPONSE_ID_PATTERN
from router.state.responses import StoredResponse
from router.telemetry.request_observer import RequestObserver


class _Request(BaseModel):
    # strict: a field is of its stated type (a 0 is not a false), as the document says
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    # an output_text given back as it came
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=TOOL_NAME.pattern)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem,
                      Field(union_mode="left_to_right")]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_state_rules)
    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (REQUIRED_NEEDS_TOOLS,)

    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(None, description="accepted; nothing extra to include "
                                      "(no reasoning, no search)")
    text: TextConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: required needs tools")
        return self


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's ``input`` as chat messages (OpenAI's chat shapes)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # calls made together: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    return messages


def chat_request(request: ResponsesRequest, history: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat completion a response runs as; a field of the chat request that is wrong is
    named as the Responses request names it."""
    turn = input_messages(request)
    _check_call_outputs(request, history)
    messages = ([{"role": "system", "content": request.instructions}]
                if request.instructions else []) + history + turn
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in request.tools]
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.tool_choice is not None and request.tools:
        choice = request.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    form = request.text.format if request.text is not None else None
    if form is not None and form.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": form.name or "output", "schema": form.schema_ or {}}}
    for name, value in (("max_completion_tokens", request.max_output_tokens),
                        ("temperature", request.temperature), ("top_p", request.top_p),
                        ("user", request.user)):
        if value is not None:
            body[name] = value
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # named as this request names the field
        from router.api.routes import describe_validation_error  # (routes imports this module)

        message, param = describe_validation_error(exc.errors())
        ours = _responses_param(param)
        if param and ours and ours != param:
            message = message.replace(param, ours, 1)
        raise InvalidRequestError(message, param=ours) from None


def _check_call_outputs(request: ResponsesRequest, history: list[dict[str, Any]]) -> None:
    """Each ``function_call_output`` answers a call made before it; a named ``tool_choice``
    names a tool."""
    calls = {c["id"] for m in history for c in m.get("tool_calls") or []}
    for i, item in enumerate(request.input if isinstance(request.input, list) else []):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise InvalidRequestError(
                f"input[{i}].call_id: no function call {item.call_id!r} before it (in this "
                "input or the previous response)", param=f"input[{i}].call_id",
                code=TOOL_REFERENCE)
    names = [t.name for t in request.tools or []]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: two tools have the same name", param="tools",
                                  code=TOOL_REFERENCE)
    if request.tool_choice is not None and not isinstance(request.tool_choice, str) and \
            request.tool_choice.name not in names:
        raise InvalidRequestError(f"tool_choice: no tool named {request.tool_choice.name!r} "
                                  "in tools", param="tool_choice", code=TOOL_REFERENCE)


# the chat request's fields as this request names them
_CHAT_NAMES = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
               ("response_format", "text.format"))


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ours in _CHAT_NAMES:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


# ---- the answer as output items ----


def response_id(request_id: str) -> str:
    return "resp_" + request_id.split("-")[-1]


def _item_id(kind: str, response: str, index: int) -> str:
    digest = hashlib.sha256(f"{response}:{index}".encode()).hexdigest()[:32]
    return f"{kind}_{digest}"


def _skeleton(request: ResponsesRequest, rid: str, created: int, status: str
              ) -> dict[str, Any]:
    choice = request.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None, "incomplete_details": None, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "model": request.model, "output": [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "store": request.store is not False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump())
        if choice is not None else "auto",
        "tools": [t.model_dump() for t in request.tools or []],
        "text": request.text.model_dump(by_alias=True, exclude_none=True)
        if request.text is not None and request.text.format is not None
        else {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": request.metadata or {}, "user": request.user, "usage": None}


def _usage(end: EndData) -> dict[str, Any]:
    return {"input_tokens": end.prompt_tokens,
            "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": end.prompt_tokens + end.completion_tokens}


def output_items(rid: str, message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Responses output items."""
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(_message_item(rid, len(items), message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(rid, len(items), call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    return items


def _message_item(rid: str, index: int, text: str, status: str = "completed"
                  ) -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg", rid, index), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(rid: str, index: int, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc", rid, index), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def finished(skeleton: dict[str, Any], completion: dict[str, Any], end: EndData
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Response object, the assistant message for the conversation) of an answer."""
    choice = completion["choices"][0]
    message = choice["message"]
    response = {**skeleton, "output": output_items(skeleton["id"], message),
                "usage": _usage(end)}
    if choice["finish_reason"] == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    kept = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return response, kept


class StreamEvents:
    """A chat stream's deltas as the Responses API's typed events, numbered in order."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton
        self.rid = skeleton["id"]
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items so far
        self.text_item: int | None = None  # the message item being written
        self.calls: dict[int, int] = {}  # tool call index -> its output item

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> str:
        return (self._event("response.created", response=self.skeleton)
                + self._event("response.in_progress", response=self.skeleton))

    def delta(self, delta: dict[str, Any]) -> str:
        out = []
        if delta.get("content"):
            if self.text_item is None:
                self.text_item = len(self.items)
                item = _message_item(self.rid, self.text_item, "", "in_progress")
                item["content"] = []
                self.items.append(item)
                out.append(self._event("response.output_item.added",
                                       output_index=self.text_item, item=item))
                out.append(self._event("response.content_part.added", item_id=item["id"],
                                       output_index=self.text_item, content_index=0,
                                       part={"type": "output_text", "text": "",
                                             "annotations": []}))
                item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            item = self.items[self.text_item]
            item["content"][0]["text"] += delta["content"]
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=self.text_item, content_index=0,
                                   delta=delta["content"], logprobs=[]))
        for entry in delta.get("tool_calls") or []:
            out.append(self._call_delta(entry))
        return "".join(out)

    def _call_delta(self, entry: dict[str, Any]) -> str:
        if "id" in entry:  # a call's header: its own output item
            index = self.calls[entry["index"]] = len(self.items)
            item = _call_item(self.rid, index, entry["id"], entry["function"]["name"], "",
                              "in_progress")
            self.items.append(item)
            return self._event("response.output_item.added", output_index=index, item=item)
        index = self.calls[entry["index"]]
        item = self.items[index]
        piece = entry["function"].get("arguments") or ""
        item["arguments"] += piece
        return self._event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=piece)

    def closing(self, response: dict[str, Any]) -> str:
        out = []
        for index, item in enumerate(self.items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out.append(self._event("response.output_text.done", item_id=item["id"],
                                       output_index=index, content_index=0, text=text,
                                       logprobs=[]))
                out.append(self._event("response.content_part.done", item_id=item["id"],
                                       output_index=index, content_index=0,
                                       part=item["content"][0]))
            else:
                out.append(self._event("response.function_call_arguments.done",
                                       item_id=item["id"], output_index=index,
                                       arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if response["status"] == "completed" else \
            "response.incomplete"
        out.append(self._event(kind, response=response))
        return "".join(out)

    def failed(self, error: RouterError) -> str:
        response = {**self.skeleton, "status": "failed", "output": self.items,
                    "error": {"code": error.code or error.type, "message": error.message}}
        return self._event("response.failed", response=response)


# ---- what the document says of the answers ----


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class MessageOutput(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's Response object, the fields fairserve fills."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Annotated[MessageOutput | FunctionCallOutput, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


# ---- the routes ----


ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN.pattern, description="resp_...")]


def register(app: FastAPI, service: Any, raise_if_failed: Any,
             errors: dict[int | str, dict[str, Any]]) -> None:
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
        return await _create(service, body, authorization, raise_if_failed)

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


async def _create(service: Any, body: ResponsesRequest, authorization: str | None,
                  raise_if_failed: Any) -> Any:
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
    skeleton = _skeleton(body, response_id(submission.request_id), int(time.time()),
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
            _stream(service, submission, shaper, skeleton, observer, save, raise_if_failed),
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
                  observer: RequestObserver, save: Any, raise_if_failed: Any
                  ) -> AsyncIterator[str]:
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
