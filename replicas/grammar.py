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
it: ``replicas/engine/guide.py``), so what was accepted is what runs. This module imports no
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
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class GrammarError(ValueError):
    """A response format that cannot be compiled; the message says why."""


def grammar_for(kind: str, schema: str = "") -> str:
    """The llguidance grammar of a ``json_object`` (any object) or a ``json_schema`` format
    (``schema``: the JSON Schema as JSON text), or of ``tool_calls``: ``<tool_call>``, a JSON
    array under ``schema`` (the calls: router/api/tools.py), ``</tool_call>``."""
    if kind == "tool_calls":
        return _tool_calls_grammar(schema)
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


def check_grammar(kind: str, schema: str = "") -> None:
    """Raises ``GrammarError`` when the format cannot be compiled (no tokenizer needed)."""
    problem = llguidance.LLMatcher.validate_grammar(grammar_for(kind, schema))
    if problem:
        raise GrammarError(problem)
