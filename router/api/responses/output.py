"""An answer as Responses output items: the Response object's skeleton (what the request
set), its usage, a chat message as output items (a ``message`` with ``output_text``,
``function_call``s), and the finished Response with the assistant message kept for the
conversation. Item ids are derived from the response id and the item's index, so the stream
events and the stored response name each item alike."""

from __future__ import annotations

import hashlib
from typing import Any

from router.api.responses import ResponsesRequest
from router.dispatch.response_events import EndData


def response_id(request_id: str) -> str:
    return "resp_" + request_id.split("-")[-1]


def _item_id(kind: str, response: str, index: int) -> str:
    digest = hashlib.sha256(f"{response}:{index}".encode()).hexdigest()[:32]
    return f"{kind}_{digest}"


def response_skeleton(request: ResponsesRequest, rid: str, created: int, status: str
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
        items.append(message_item(rid, len(items), message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(rid, len(items), call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    return items


def message_item(rid: str, index: int, text: str, status: str = "completed"
                  ) -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg", rid, index), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(rid: str, index: int, call_id: str, name: str, arguments: str,
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
