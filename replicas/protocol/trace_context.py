"""The W3C trace context a call carries (``ReplicaCall.trace``): the router's dispatcher puts
its ``fairserve.dispatch`` span's context in (``carrier``), the replica parents its engine spans
on it (``context_of``; ``replicas/tracing.py``). The router carries a request's context through
Redis in the same form (``router/telemetry/tracing.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span


def carrier(span: Span | None = None) -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` of ``span`` (default: the current one)."""
    out: dict[str, str] = {}
    context = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(out, context=context)
    return out


def context_of(fields: Mapping[str, str] | None) -> Context | None:
    if not fields or "traceparent" not in fields:
        return None
    return propagate.extract(dict(fields))
