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


class GrammarError(ValueError):
    """A response format that cannot be compiled; the message says why."""


def grammar_for(kind: str, schema: str = "") -> str:
    """The llguidance grammar of a ``json_object`` (any object) or a ``json_schema`` format
    (``schema``: the JSON Schema as JSON text)."""
    if kind == "json_object":
        document: Any = ANY_JSON_OBJECT
    elif kind == "json_schema":
        try:
            document = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(document, dict):
            raise GrammarError("the schema must be a JSON object")
    else:
        raise GrammarError(f"unknown structured output kind {kind!r}")
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(document, overrides=JSON_OPTIONS))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def check_grammar(kind: str, schema: str = "") -> None:
    """Raises ``GrammarError`` when the format cannot be compiled (no tokenizer needed)."""
    problem = llguidance.LLMatcher.validate_grammar(grammar_for(kind, schema))
    if problem:
        raise GrammarError(problem)
