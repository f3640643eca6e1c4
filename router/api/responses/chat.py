"""A Responses request as the chat completion it runs as: its ``instructions``, the
conversation of its ``previous_response_id`` and its ``input`` items become chat messages (a
``function_call`` item an assistant message with ``tool_calls``, a ``function_call_output`` a
``tool`` message), its function tools chat tools; a chat field that is wrong is named as the
Responses request names it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from router.api.error_handlers import describe_validation_error
from router.api.openai_models import ChatCompletionRequest
from router.api.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from router.errors import TOOL_REFERENCE, InvalidRequestError


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
