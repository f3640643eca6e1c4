"""A request's end event as the error its client is answered with: a failed, dead-lettered or
cancelled request raises the ``RouterError`` that the error handlers (``error_handlers.py``)
or the SSE writer (``sse.py``) turn into an OpenAI error body."""

from __future__ import annotations

from router.dispatch.response_events import EndData
from router.errors import RouterError


def raise_if_failed(end: EndData) -> None:
    if end.error is not None:
        error = RouterError(end.error.get("message", "the request failed"), end.error.get("param"))
        error.status = int(end.error.get("status", 500))
        error.type = end.error.get("type", "server_error")
        error.code = end.error.get("code")
        raise error
    if end.outcome == "dead":
        error = RouterError(f"the request could not be served ({end.reason})")
        error.code = "dead_lettered"
        raise error
    if end.outcome == "cancelled":
        error = RouterError(f"the request was cancelled ({end.reason})")
        error.status, error.code = 499, "cancelled"
        raise error
