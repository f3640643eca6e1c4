"""Tracing: the OpenTelemetry SDK set up from the standard ``OTEL_*`` variables, the W3C context
carried through Redis, and the spans of the router (HTTP server, queue, dispatch).

NOTE: one trace per request, every span timed where its event happened:
- ``POST /v1/...`` (SERVER, the router that holds the client's connection): continues the
  client's ``traceparent``; ends when the response (or the stream) is done; carries the
  ``gen_ai.*`` attributes, the usage and latencies of the whole request.
- ``fairserve.queue`` (admission → grant): its start is taken by the admitting router, right
  after the admit script, and travels in the request's ``meta`` with the server span's
  context; the dispatcher that wins the grant ends it at the instant the grant returned.
- ``fairserve.dispatch`` (grant → completion), by that dispatcher; its context goes to the
  replica in the call, whose ``fairserve.engine.queue``/``prefill``/``decode`` spans are its
  children (``replicas/tracing.py``), timed from the engine's own timings.
The router and the dispatcher can be different processes: the trace is joined by the context
in Redis, not by a process. Only the first delivery has a queue span; a request handed back
(replica lost before its first token) shows as a dispatch span that ended ``requeued`` and a
second dispatch span with ``fairserve.delivery`` 2.

Off unless asked for (an OTLP endpoint or ``OTEL_TRACES_EXPORTER`` set, and
``OTEL_SDK_DISABLED`` not true): then no provider exists, ``Tracing.tracer`` is ``None`` and the
request path skips every tracing call. Sampling is the SDK's, from ``OTEL_TRACES_SAMPLER``
(default parent-based always-on: a client's unsampled ``traceparent`` is honoured too).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRACER_NAME = "fairserve"
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True, slots=True)
class Tracing:
    """A process's tracer, or none when tracing is off."""

    tracer: Tracer | None
    provider: TracerProvider | None = None

    @property
    def is_on(self) -> bool:
        return self.tracer is not None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


OFF = Tracing(None)


def is_requested(env: Mapping[str, str] = os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return any(name.strip() not in ("", "none") for name in exporters.split(","))
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure_tracing(default_service_name: str, env: Mapping[str, str] = os.environ) -> Tracing:
    """A tracer from ``OTEL_*`` (``OTEL_SERVICE_NAME`` wins over the default name)."""
    if not is_requested(env):
        return OFF
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME")
                                or default_service_name})
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
    for exporter in _exporters(env):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider.get_tracer(TRACER_NAME), provider)


def _exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    out: list[SpanExporter] = []
    for name in names:
        if name == "console":
            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            out.append(_otlp_exporter(env))
        elif name not in ("", "none"):
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} "
                             "(otlp, console or none)")
    return out


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )
        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r} "
                     f"({' or '.join(OTLP_PROTOCOLS)})")


# ---- the context across processes (its W3C carrier: replicas/protocol/trace_context.py) ----


def encode_meta(fields: Mapping[str, Any], admitted_ns: int) -> str:
    """The request's ``meta`` in Redis: its trace context, its admission instant, and what
    else the router keeps with it (its response shape)."""
    return json.dumps({**fields, "admitted_ns": admitted_ns}, separators=(",", ":"))


def decode_meta(meta: str) -> dict[str, Any]:
    try:
        out = json.loads(meta) if meta else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def now_ns() -> int:
    return time.time_ns()


# ---- the HTTP server span ----


class ServerSpans:
    """ASGI middleware: one SERVER span per HTTP request, current while the app runs, ended
    when the last body byte is sent (so a stream's span lasts as long as the stream)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracer = tracing.tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.tracer is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        with self.tracer.start_as_current_span(
            f"{method} {path}", context=propagate.extract(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "http.route": path,
                        "url.scheme": scope.get("scheme", "http")},
            record_exception=False, set_status_on_exception=False,
        ) as span:
            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, traced_send)
            except BaseException as exc:
                span.set_attribute("error.type", type(exc).__name__)
                raise


# ---- the queue and dispatch spans (the dispatcher's side) ----


@dataclass(frozen=True, slots=True)
class QueueFacts:
    tenant_id: str
    priority: int
    queue_depth: int  # the tenant's queue length right after the admission
    reserved_tokens: int


def record_queue_span(tracer: Tracer, parent: Context | None, facts: QueueFacts,
                      admitted_ns: int, granted_ns: int) -> None:
    span = tracer.start_span("fairserve.queue", context=parent, kind=SpanKind.INTERNAL,
                             start_time=admitted_ns, attributes={
                                 "fairserve.tenant": facts.tenant_id,
                                 "fairserve.priority": facts.priority,
                                 "fairserve.queue.depth": facts.queue_depth,
                                 "fairserve.queue.position": max(0, facts.queue_depth - 1),
                                 "fairserve.reserved_tokens": facts.reserved_tokens})
    span.end(end_time=max(granted_ns, admitted_ns))


def start_dispatch_span(tracer: Tracer, parent: Context | None, request_id: str, holder: str,
                        delivery: int, granted_ns: int) -> Span:
    return tracer.start_span("fairserve.dispatch", context=parent, kind=SpanKind.INTERNAL,
                             start_time=granted_ns, attributes={
                                 "fairserve.request_id": request_id,
                                 "fairserve.lease.holder": holder,
                                 "fairserve.delivery": delivery})
