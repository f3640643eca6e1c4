"""Checks schemathesis runs besides its own (loaded with ``SCHEMATHESIS_HOOKS``).

``accepts_valid_requests`` is schemathesis' ``positive_data_acceptance`` (a request valid by
the document must not be refused) knowing the one kind of refusal a document cannot rule out:
a 400 whose ``error.code`` is in ``router.errors.UNSTATED_RULES`` (the prompt's length in
tokens, ``min_tokens`` against ``max_tokens``, the tenant's cap, a schema the grammar compiler
cannot take, a resume position past the stream), a 413 for a request over a tenant's limit,
and a 422 for an ``Idempotency-Key`` used before with another body (state, as a 409 is). Any
other 4xx of a valid request fails. ``reaches_the_model`` fails the run if a generating operation never answered 2xx, so a
run where every request was refused cannot pass.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import schemathesis

from router.errors import UNSTATED_RULES

ALLOWED = {401, 403, 404, 409, 429}  # schemathesis' own list, less 5xx (not_a_server_error's)
GENERATING = {"POST /v1/chat/completions", "POST /v1/completions"}


def _code(response: Any) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _parameters_valid(case: Any) -> bool:
    """The headers and query as sent, checked against the operation's parameters."""
    sent = {"header": {k.lower(): v for k, v in (case.headers or {}).items()},
            "query": dict(case.query or {})}
    for parameter in case.operation.definition.raw.get("parameters", []):
        where = sent.get(parameter["in"])
        name = parameter["name"].lower() if parameter["in"] == "header" else parameter["name"]
        if where is None or name not in where:
            continue
        value = where[name]
        if parameter["schema"].get("type") == "boolean" and isinstance(value, str):
            value = {"true": True, "false": False}.get(value, value)
        if not jsonschema.Draft202012Validator(parameter["schema"]).is_valid(value):
            return False
    return True


@schemathesis.check
def accepts_valid_requests(ctx: Any, response: Any, case: Any) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    if any(not part.mode.is_positive for part in meta.components.values()):
        return None  # one part (a header, the query) was generated invalid
    if not _parameters_valid(case):
        return None  # the coverage phase fills an optional header with "0" whatever its schema
    status = response.status_code
    if status < 400 or status >= 500 or status in ALLOWED:
        return None
    code = _code(response)
    if status == 400 and code in UNSTATED_RULES:
        return None
    if status == 413 and code == "request_too_large":
        return None
    if status == 422 and code == "idempotency_key_reused":  # state, as 409 is
        return None
    raise AssertionError(f"a request valid by the document was refused: {status} {code}: "
                         f"{response.text[:300]}")


@schemathesis.check
class ReachesTheModel:
    """Every generating operation answered 2xx at least once."""

    def __init__(self) -> None:
        self.reached: set[str] = set()
        self.tested: set[str] = set()

    def after_response(self, ctx: Any, response: Any, case: Any) -> None:
        label = case.operation.label
        if label in GENERATING:
            self.tested.add(label)
            if 200 <= response.status_code < 300:
                self.reached.add(label)

    def after_run(self, ctx: Any) -> None:
        missing = sorted(self.tested - self.reached)
        if missing:
            raise AssertionError(f"never answered 2xx: {', '.join(missing)}")
