"""The grammars of OpenAI's ``response_format``, as llguidance builds them.

NOTE: why llguidance. Structured output needs a library that turns a JSON Schema into a token
mask at every step. Three are in use in the field (vLLM ships all three): xgrammar, llguidance
and outlines-core. xgrammar's Linux wheel requires ``triton`` (a GPU compiler, hundreds of MB)
even for CPU use; outlines-core builds a regex index over the whole vocabulary for each new
schema (seconds for a 49k vocabulary) before the first token. llguidance has no dependencies
(one Rust extension, abi3), compiles a schema lazily in well under a millisecond, computes a
mask in about 30 µs on this CPU for SmolLM2's 49,152 tokens, and validates a grammar without a
tokenizer, so the router can refuse a schema it cannot compile before anything is queued.

The same function builds the grammar on both sides (the router checks it, the replica enforces
it: ``replicas/torch_engine/guide.py``), so what was accepted is what runs. This module imports no
torch: the router uses it.

JSON comes out in ``json.dumps``'s default layout (``", "`` and ``": "``, no other whitespace):
what small models were trained on, and no room for a model to loop on whitespace forever.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# a forced tool call (router/api/tools.py): the block around the JSON array of calls
# (fairserve's format), or around each call object (Hermes')
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# at most this many calls in a forced answer: a small model sampled hot may call one tool over
# and over until max_tokens cuts a call in two
MAX_FORCED_CALLS = 16


class GrammarError(ValueError):
    """A response format that cannot be compiled; the message says why."""


def grammar_for(kind: str, schema: str = "") -> str:
    """The llguidance grammar of a ``json_object`` (any object) or a ``json_schema`` format
    (``schema``: the JSON Schema as JSON text), or of a forced tool call, ``schema`` being the
    JSON Schema of the array of calls (router/api/tools.py): ``tool_calls``, ``<tool_call>``,
    that array, ``</tool_call>``; ``tool_call_blocks`` (Hermes'), each call of the array as an
    object in a block of its own, ``<tool_call>\n{...}\n</tool_call>``, a newline between."""
    if kind == "tool_calls":
        return _tool_calls_grammar(schema)
    if kind == "tool_call_blocks":
        return _tool_call_blocks_grammar(schema)
    if kind == "json_object":
        document: Any = ANY_JSON_OBJECT
    elif kind == "json_schema":
        document = _schema_object(schema, "the schema")
    else:
        raise GrammarError(f"unknown structured output kind {kind!r}")
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(document, overrides=JSON_OPTIONS))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def _schema_object(schema: str, what: str) -> dict[str, Any]:
    try:
        document = json.loads(schema)
    except ValueError as exc:
        raise GrammarError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise GrammarError(f"{what} must be a JSON object")
    return document


def _tool_calls_grammar(schema: str) -> str:
    document = _schema_object(schema, "the tools' schema")
    document["x-guidance"] = dict(JSON_OPTIONS)
    lark = (f"start: {json.dumps(TOOL_CALL_OPEN)} calls {json.dumps(TOOL_CALL_CLOSE)}\n"
            f"calls: %json {json.dumps(document)}\n")
    try:
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def _tool_call_blocks_grammar(schema: str) -> str:
    document = _schema_object(schema, "the tools' schema")
    item = document.get("items")
    if not isinstance(item, dict):
        raise GrammarError("the tools' schema must be an array of calls with items")
    item = {**item, "x-guidance": dict(JSON_OPTIONS)}
    most = int(document.get("maxItems", MAX_FORCED_CALLS))
    block = f'{json.dumps(TOOL_CALL_OPEN + chr(10))} call {json.dumps(chr(10) + TOOL_CALL_CLOSE)}'
    more = " ".join(['("\\n" block)?'] * (most - 1))
    lark = (f"start: block {more}\n" f"block: {block}\n" f"call: %json {json.dumps(item)}\n")
    try:
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def check_grammar(kind: str, schema: str = "") -> None:
    """Raises ``GrammarError`` when the format cannot be compiled (no tokenizer needed)."""
    problem = llguidance.LLMatcher.validate_grammar(grammar_for(kind, schema))
    if problem:
        raise GrammarError(problem)
