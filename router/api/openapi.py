"""The OpenAPI document a live router serves: FastAPI's, made exact for this deployment.

FastAPI writes the request and response models; this adds what only the running cluster
knows, so that a request valid by the document is one the cluster accepts (schemathesis
checks both ways in CI): the served model's name, ``n`` up to ``router.api.max_n``, token ids
inside the vocabulary, token counts inside the context. The SSE bodies' models become named
components (an inline ``model_json_schema()`` would leave its ``$ref``s dangling), and the API
key is a bearer security scheme.

What no document can state stays a 400 with an ``error.code`` from ``errors.UNSTATED_RULES``:
the prompt's length in tokens, ``min_tokens`` against ``max_tokens``, a tenant's own cap, and
a ``response_format`` schema the grammar compiler cannot take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router.api.openai_models import ChatCompletionChunk, CompletionChunk

REF_TEMPLATE = "#/components/schemas/{model}"
# a Redis stream entry id, and each choice's output tokens the client had (ReadPoint)
EVENT_ID_PATTERN = r"^[0-9]{1,20}-[0-9]{1,20}(;[0-9]{1,10}(,[0-9]{1,10}){0,127})?$"
SSE_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionChunk,
    ("/v1/chat/completions/{request_id}", "get"): ChatCompletionChunk,
    ("/v1/completions", "post"): CompletionChunk,
    ("/v1/completions/{request_id}", "get"): CompletionChunk}


@dataclass(frozen=True)
class DeploymentLimits:
    model_name: str
    max_n: int
    vocab_size: int
    context_tokens: int  # prompt + output


def openapi_document(app: FastAPI, limits: DeploymentLimits) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    models = list(dict.fromkeys(SSE_MODELS.values()))
    _, defs = models_json_schema([(m, "serialization") for m in models],
                                 ref_template=REF_TEMPLATE)
    schemas.update(defs.get("$defs", {}))
    for (path, method), model in SSE_MODELS.items():
        content = doc["paths"][path][method]["responses"]["200"]["content"]
        content["text/event-stream"] = {"schema": sse_event_schema(model.__name__)}
    for operations in doc["paths"].values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                _not_null(parameter)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        _bound_request(schemas[name]["properties"], limits)
    if "ResponsesRequest" in schemas:
        responses = schemas["ResponsesRequest"]["properties"]
        responses["model"] = {**responses["model"], "enum": [limits.model_name]}
        _set(responses["max_output_tokens"], "integer", maximum=limits.context_tokens - 1)
    return doc


def sse_event_schema(chunk_model: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI before 3.2 describes each event, not the stream): its
    ``data`` is a chunk, an error body, or ``[DONE]``; its ``id`` is there but on the openers."""
    return {"type": "object", "required": ["data"], "properties": {
        "id": {"type": "string", "pattern": EVENT_ID_PATTERN},
        "event": {"type": "string"},
        "data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": {
                "anyOf": [{"$ref": REF_TEMPLATE.format(model=chunk_model)},
                          {"$ref": REF_TEMPLATE.format(model="ErrorBody")}]}}]}}}


def _not_null(parameter: dict[str, Any]) -> None:
    """A header or query parameter is absent or a string, never ``null`` (which a client
    would have to send as the text "null"): ``str | None`` becomes ``str``."""
    schema = parameter.get("schema", {})
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    if len(branches) == 1 and len(schema["anyOf"]) == 2:
        rest = {k: v for k, v in schema.items()
                if k != "anyOf" and not (k == "default" and v is None)}
        parameter["schema"] = {**branches[0], **rest}


def _bound_request(properties: dict[str, Any], limits: DeploymentLimits) -> None:
    last_id = limits.vocab_size - 1
    properties["model"] = {**properties["model"], "enum": [limits.model_name]}
    _set(properties["n"], "integer", maximum=limits.max_n)
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if name in properties:  # a prompt has a token at least
            _set(properties[name], "integer", maximum=limits.context_tokens - 1)
    _set(properties["stop_token_ids"], "array", items={"type": "integer", "minimum": 0,
                                                       "maximum": last_id})
    bias = _branch(properties["logit_bias"], "object")
    bias["propertyNames"] = {"pattern": f"^{range_pattern(last_id)}$"}
    prompt = properties.get("prompt")
    if prompt is not None:  # completions: token ids, or text
        for branch in prompt["anyOf"]:
            if branch.get("type") == "array" and branch["items"].get("type") == "integer":
                branch["items"] = {"type": "integer", "minimum": 0, "maximum": last_id}


def _branch(schema: dict[str, Any], kind: str) -> dict[str, Any]:
    """The ``kind`` branch of an ``anyOf`` (an optional field), or the schema itself."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == kind:
            return branch
    raise KeyError(f"no {kind} in {schema}")


def _set(schema: dict[str, Any], kind: str, **fields: Any) -> None:
    _branch(schema, kind).update(fields)


def range_pattern(last: int) -> str:
    """A regular expression (a group) matching the decimal numbers 0..``last``, written
    without leading zeros, e.g. ``range_pattern(49151)`` for a 49,152-token vocabulary."""
    if last < 0:
        raise ValueError("the range is empty")
    digits = str(last)
    if len(digits) == 1:
        return f"([0-{last}])"
    alternatives = ["0", "[1-9]"] + [  # every number shorter than last
        "[1-9]" + "[0-9]" * (width - 1) for width in range(2, len(digits))]
    for i, digit in enumerate(digits):  # as long as last: its first i digits, then a smaller one
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            span = str(low) if low == high else f"[{low}-{high}]"
            alternatives.append(digits[:i] + span + "[0-9]" * (len(digits) - i - 1))
    alternatives.append(digits)
    return "(" + "|".join(alternatives) + ")"
