"""The replica's spans of one request: ``fairserve.engine.queue`` (arrived → first scheduled),
``fairserve.prefill`` (first scheduled → first token) and ``fairserve.decode`` (first token →
finished), children of the dispatcher's ``fairserve.dispatch`` span whose context came with the
call. They are timed with the engine's own instants (``Timings``, taken as each event happened)
and recorded when the request finishes; a phase the request never reached has no span.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.util.types import Attributes

from replicas.engine.interface import Timings, Usage
from replicas.protocol import context_of


def record_engine_spans(tracer: Tracer, trace_fields: Mapping[str, str] | None,
                        replica_id: str, timings: Timings, usage: Usage) -> None:
    parent = context_of(trace_fields)
    if parent is None:
        return
    common = {"fairserve.replica.id": replica_id}
    phases: list[tuple[str, float | None, float | None, Attributes]] = [
        ("fairserve.engine.queue", timings.arrived_s, timings.first_scheduled_s, {}),
        ("fairserve.prefill", timings.first_scheduled_s, timings.first_token_s, {
            "fairserve.prefill.chunks": timings.num_prefill_chunks,
            "fairserve.prefill.cached_tokens": usage.num_cached_tokens,
            "gen_ai.usage.input_tokens": usage.num_prompt_tokens}),
        ("fairserve.decode", timings.first_token_s, timings.finished_s, {
            "gen_ai.usage.output_tokens": usage.num_output_tokens,
            "fairserve.decode.preemptions": timings.num_preemptions}),
    ]
    for name, start_s, end_s, attributes in phases:
        if start_s is None or end_s is None:
            continue
        span = tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL,
                                 start_time=int(start_s * 1e9),
                                 attributes={**common, **dict(attributes or {})})
        span.end(end_time=int(max(end_s, start_s) * 1e9))
