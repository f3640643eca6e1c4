"""A request's sampling fields as a replica takes them (``replicas/engine/sampling_params.py``),
checked against the model and the deployment before anything is queued.

What the schema (``openai_models.py``) cannot know is checked here, each a 400 naming its
field: ``n`` against ``router.api.max_n``, token ids in ``logit_bias`` and ``stop_token_ids``
against the vocabulary, and a ``response_format`` schema against the grammar compiler the
replicas use (``replicas/protocol/grammar.py``), so a request is never accepted only to fail
later.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from replicas.protocol import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, GrammarError, check_grammar
from router.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
)
from router.api.tools import ToolFormat, calls_schema
from router.errors import UNSUPPORTED_SCHEMA, InvalidRequestError
from router.state.keys import STREAM_MAX_EVENTS

Request = ChatCompletionRequest | CompletionRequest


async def check_sampling(request: Request, vocab_size: int, max_n: int,
                         fmt: ToolFormat = ToolFormat.FAIRSERVE) -> None:
    """Raises ``InvalidRequestError`` naming the field the model or deployment cannot take.
    A schema is compiled on a worker thread: a large one takes milliseconds of CPU that would
    otherwise stall every stream this router serves."""
    if request.n > max_n:
        raise InvalidRequestError(f"n: at most {max_n} choices per request, got {request.n}",
                                  param="n")
    for name, ids in (("logit_bias", [int(k) for k in request.logit_bias or {}]),
                      ("stop_token_ids", request.stop_token_ids or [])):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise InvalidRequestError(
                f"{name}: token id {outside[0]} is not in the vocabulary [0, {vocab_size})",
                param=name)
    spec = structured_output(request, fmt)
    if spec is not None:
        param = "tools" if spec["kind"].startswith("tool_call") else "response_format"
        _check_schema_bounds(spec["schema"], param)
        try:
            if spec["schema"]:
                await asyncio.to_thread(check_grammar, spec["kind"], spec["schema"])
            else:
                check_grammar(spec["kind"], spec["schema"])
        except GrammarError as exc:
            raise InvalidRequestError(f"{param}: the schema cannot be compiled: {exc}",
                                      param=param, code=UNSUPPORTED_SCHEMA) from None


def structured_output(request: Request, fmt: ToolFormat = ToolFormat.FAIRSERVE
                      ) -> dict[str, str] | None:
    """The wire form of ``response_format``, or of a forced tool call (``tool_choice``
    ``required`` or a named function) in the model's format (router/api/tools.py); None for
    free text."""
    if isinstance(request, ChatCompletionRequest) and request.tool_mode not in ("none", "auto"):
        if request.response_format is not None and request.response_format.type != "text":
            raise InvalidRequestError("tool_choice: a forced tool call and a JSON "
                                      "response_format cannot both shape the answer",
                                      param="tool_choice")
        assert request.tools is not None
        kind = "tool_call_blocks" if fmt is ToolFormat.HERMES else "tool_calls"
        return {"kind": kind, "schema": json.dumps(calls_schema(
            request.tools, request.tool_mode, request.parallel_tool_calls))}
    form = request.response_format
    if isinstance(form, JsonObjectFormat):
        return {"kind": "json_object", "schema": ""}
    if isinstance(form, JsonSchemaFormat):
        return {"kind": "json_schema", "schema": json.dumps(form.json_schema.json_schema)}
    return None


def sampling_wire(request: Request, max_tokens: int, fmt: ToolFormat = ToolFormat.FAIRSERVE
                  ) -> dict[str, Any]:
    """The sampling parameters sent to the replica (plain JSON)."""
    if isinstance(request, ChatCompletionRequest):
        logprobs, top = request.logprobs, request.top_logprobs or 0
    else:
        logprobs, top = request.logprobs is not None, request.logprobs or 0
    wire: dict[str, Any] = {
        "max_tokens": max_tokens, "min_tokens": request.min_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "seed": request.seed,
        "stop": list(request.stop_strings), "logprobs": logprobs, "top_logprobs": top}
    extras: dict[str, Any] = {
        "n": request.n, "top_k": max(request.top_k or 0, 0), "min_p": request.min_p,
        "ignore_eos": request.ignore_eos, "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": [[int(k), v] for k, v in (request.logit_bias or {}).items()],
        "stop_token_ids": list(request.stop_token_ids or []),
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "structured_output": structured_output(request, fmt),
    }
    defaults = {"n": 1, "top_k": 0, "min_p": 0.0, "ignore_eos": False, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": [],
                "stop_token_ids": [], "include_stop_str_in_output": False,
                "skip_special_tokens": True, "structured_output": None}
    # only what differs from the engine's defaults travels (request bodies stay small)
    wire.update({k: v for k, v in extras.items() if v != defaults[k]})
    return wire


def _check_schema_bounds(schema: str, param: str = "response_format") -> None:
    """A schema is compiled into a grammar for each request that sends it, on the router and
    on the replica: its size and nesting are capped before that (``MAX_SCHEMA_BYTES``,
    ``MAX_SCHEMA_DEPTH``)."""
    problem = None
    if len(schema) > MAX_SCHEMA_BYTES:
        problem = f"it has {len(schema)} bytes as JSON; at most {MAX_SCHEMA_BYTES} are allowed"
    elif schema and _depth(json.loads(schema)) > MAX_SCHEMA_DEPTH:
        problem = f"it nests deeper than {MAX_SCHEMA_DEPTH} levels"
    if problem is not None:
        raise InvalidRequestError(f"{param}: the schema is too large: {problem}",
                                  param=param, code=UNSUPPORTED_SCHEMA)


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (a scalar: 0), without recursion, and
    no further than one level past the cap."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            return depth
        pending.extend((child, depth + 1) for child in children)
    return deepest


# text-only chunks a choice may send besides one chunk per token step (the final flush of text
# held back for a stop string or a multi-byte character), and the end event
STREAM_EVENTS_SLACK = 4


def stream_max_tokens(num_choices: int) -> int:
    """The most output tokens per choice one response stream holds in full: a stream is capped
    at ``keys.STREAM_MAX_EVENTS`` events (XADD MAXLEN), and a trimmed stream could no longer
    tell a takeover what its client was sent, so no request may need more than that."""
    return (STREAM_MAX_EVENTS - STREAM_EVENTS_SLACK) // num_choices - STREAM_EVENTS_SLACK
