"""What a dispatcher writes into a request's response stream, and what a reader makes of it.

Event types: ``chunk`` (new text, the new tokens' ids and count, the position they bring their
choice to (its output tokens so far), their logprobs; the choice's index when n > 1, and its
finish reason on its last chunk), ``end``
(terminal: finish reason, usage summed over the choices, engine timings, and each choice's
finish reason; or ``outcome`` for a request that ended unserved, or ``error`` for one that
failed) and ``error`` (terminal: dead-lettered). Data is JSON.
Logprobs travel as ``[token text, logprob, [[text, logprob], ...]]`` and are shaped into the
chat or completions form by the reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.errors import RouterError
from router.messages import StreamEvent

CHUNK = "chunk"
END = "end"


@dataclass(slots=True)
class ChunkData:
    text: str
    num_tokens: int
    logprobs: list[Any] | None = None
    index: int = 0  # the choice
    finish_reason: str | None = None  # set on a choice's last chunk
    token_ids: list[int] | None = None
    position: int = 0  # the choice's output tokens once this chunk is in (0: no token)


@dataclass(slots=True)
class EndData:
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    outcome: str | None = None  # "cancelled" or "dead" when the request ended unserved
    reason: str | None = None
    error: dict[str, Any] | None = None  # an OpenAI error object when the request failed
    finish_reasons: list[str] | None = None  # per choice, when n > 1


def chunk_data(text: str, token_ids: list[int], position: int, logprobs: list[Any] | None,
               index: int = 0, finish_reason: str | None = None) -> str:
    payload: dict[str, Any] = {"text": text, "n": len(token_ids), "t": token_ids, "p": position}
    if logprobs is not None:
        payload["lp"] = logprobs
    if index:
        payload["i"] = index
    if finish_reason is not None:
        payload["fr"] = finish_reason
    return json.dumps(payload)


def end_data(finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
             timings: dict[str, float] | None = None,
             finish_reasons: list[str] | None = None) -> str:
    payload: dict[str, Any] = {
        "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "cached_tokens": cached_tokens,
        "timings": timings or {}}
    if finish_reasons is not None:
        payload["finish_reasons"] = finish_reasons
    return json.dumps(payload)


def error_data(error: RouterError, prompt_tokens: int = 0, completion_tokens: int = 0) -> str:
    return json.dumps({"finish_reason": "error", "prompt_tokens": prompt_tokens,
                       "completion_tokens": completion_tokens,
                       "error": {"status": error.status, "message": error.message,
                                 "type": error.type, "param": error.param,
                                 "code": error.code}})


def parse(event: StreamEvent) -> ChunkData | EndData:
    data = json.loads(event.data)
    if event.type == CHUNK:
        return ChunkData(data["text"], int(data["n"]), data.get("lp"), int(data.get("i", 0)),
                         data.get("fr"), data.get("t"), int(data.get("p", 0)))
    return EndData(
        finish_reason=data.get("finish_reason"),
        prompt_tokens=int(data.get("prompt_tokens", 0)),
        completion_tokens=int(data.get("completion_tokens", 0)),
        cached_tokens=int(data.get("cached_tokens", 0)),
        timings=data.get("timings") or {},
        outcome=data.get("outcome"),
        reason=data.get("reason"),
        error=data.get("error"),
        finish_reasons=data.get("finish_reasons"),
    )
