"""What the router that holds a client's connection records about its request: where the time
went (``Server-Timing``, the usage's ``timings_ms``), the metrics, and the ``gen_ai.*``
attributes of the HTTP server span.

The phases come from the instants in the request's end event: admission and grant (taken by
the admitting router and the dispatcher), engine arrival, first scheduled, first token and
finish (taken by the engine). Time to first token, inter-token latency and the end-to-end time
are the router's own view: from the handler's start to the events it relays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from router.api.openai_models import ChatCompletionRequest, CompletionRequest
from router.dispatch.response_events import EndData
from router.errors import RouterError
from router.telemetry.metrics import UNKNOWN_TENANT, MetricsStore


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """Seconds per phase; ``None`` where the request never reached it."""

    queue_s: float | None
    engine_queue_s: float | None
    prefill_s: float | None
    decode_s: float | None

    @classmethod
    def from_timings(cls, t: dict[str, float]) -> PhaseTimes:
        def span(start: str, end: str) -> float | None:
            a, b = t.get(start), t.get(end)
            return max(0.0, b - a) if a is not None and b is not None else None

        return cls(span("admitted_s", "granted_s"), span("arrived_s", "first_scheduled_s"),
                   span("first_scheduled_s", "first_token_s"), span("first_token_s", "finished_s"))

    def as_ms(self) -> dict[str, float]:
        names = ("queue", "engine_queue", "prefill", "decode")
        values = (self.queue_s, self.engine_queue_s, self.prefill_s, self.decode_s)
        return {n: round(v * 1e3, 3) for n, v in zip(names, values, strict=True) if v is not None}

    def server_timing(self, total_s: float) -> str:
        """The ``Server-Timing`` header value (W3C): ``queue;dur=12.5, ..., total;dur=...``."""
        parts = [f"{name.replace('_', '-')};dur={ms}" for name, ms in self.as_ms().items()]
        parts.append(f"total;dur={round(total_s * 1e3, 3)}")
        return ", ".join(parts)


class RequestObserver:
    def __init__(self, metrics: MetricsStore,
                 body: ChatCompletionRequest | CompletionRequest | None) -> None:
        """``body``: None for a client resuming a request it sent before."""
        self.metrics = metrics
        self.tenant = UNKNOWN_TENANT
        self.started_s = time.perf_counter()
        self.first_token_s: float | None = None
        self._last_token_s: float | None = None
        self._is_done = False
        self.span = trace.get_current_span()
        if body is not None and self.span.is_recording():
            self.span.set_attributes({
                "gen_ai.operation.name": "chat" if isinstance(body, ChatCompletionRequest)
                else "text_completion",
                "gen_ai.request.model": body.model,
                "gen_ai.request.temperature": body.temperature,
                "gen_ai.request.top_p": body.top_p,
            })
            if isinstance(body, ChatCompletionRequest) and body.tools:
                self.span.set_attributes({"fairserve.tools.count": len(body.tools),
                                          "fairserve.tool_choice": body.tool_mode})

    def admitted(self, tenant_id: str, request_id: str, max_tokens: int) -> None:
        self.tenant = tenant_id
        if self.span.is_recording():
            self.span.set_attributes({"fairserve.tenant": tenant_id,
                                      "fairserve.request_id": request_id,
                                      "gen_ai.response.id": request_id,
                                      "gen_ai.request.max_tokens": max_tokens})

    def tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        labels = (self.tenant,)
        if self.first_token_s is None:
            self.first_token_s = now
            self.metrics.observe("fairserve_time_to_first_token_seconds", labels,
                                 now - self.started_s)
            if num_tokens > 1:  # several tokens arrived together: no gap between them
                self.metrics.observe("fairserve_inter_token_latency_seconds", labels, 0.0,
                                     num_tokens - 1)
        else:
            assert self._last_token_s is not None
            self.metrics.observe("fairserve_inter_token_latency_seconds", labels,
                                 (now - self._last_token_s) / num_tokens, num_tokens)
        self._last_token_s = now
        self.metrics.inc("fairserve_output_tokens", labels, num_tokens)

    def ended(self, end: EndData) -> PhaseTimes:
        """The request's end event arrived (served, or ended unserved)."""
        phases = PhaseTimes.from_timings(end.timings)
        e2e_s = time.perf_counter() - self.started_s
        if end.error is not None:
            self._count("failed", str(end.error.get("code") or end.error.get("type")))
        elif end.outcome is not None:
            self._count("cancelled" if end.outcome == "cancelled" else "failed", end.outcome)
        else:
            self._count("cancelled" if end.finish_reason == "abort" else "completed",
                        end.finish_reason or "")
        labels = (self.tenant,)
        self.metrics.inc("fairserve_prompt_tokens", labels, end.prompt_tokens)
        self.metrics.inc("fairserve_cached_prompt_tokens", labels, end.cached_tokens)
        self.metrics.observe("fairserve_cached_prompt_tokens_per_request", labels,
                             end.cached_tokens)
        self.metrics.observe("fairserve_e2e_request_latency_seconds", labels, e2e_s)
        for name, value in (("fairserve_queue_time_seconds", phases.queue_s),
                            ("fairserve_engine_queue_time_seconds", phases.engine_queue_s),
                            ("fairserve_prefill_time_seconds", phases.prefill_s),
                            ("fairserve_decode_time_seconds", phases.decode_s)):
            if value is not None:
                self.metrics.observe(name, labels, value)
        if self.span.is_recording():
            self.span.set_attributes(self._span_attributes(end, phases, e2e_s))
        return phases

    def _span_attributes(self, end: EndData, phases: PhaseTimes, e2e_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gen_ai.usage.input_tokens": end.prompt_tokens,
            "gen_ai.usage.output_tokens": end.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": end.cached_tokens,
            "gen_ai.latency.e2e": e2e_s,
        }
        if end.finish_reason:
            out["gen_ai.response.finish_reasons"] = [end.finish_reason]
        if phases.queue_s is not None:  # the tenant queue and the engine's, as one wait
            out["gen_ai.latency.time_in_queue"] = phases.queue_s + (phases.engine_queue_s or 0)
        if self.first_token_s is not None:
            out["gen_ai.latency.time_to_first_token"] = self.first_token_s - self.started_s
        if phases.prefill_s is not None:
            out["gen_ai.latency.time_in_model_prefill"] = phases.prefill_s
        if phases.decode_s is not None:
            out["gen_ai.latency.time_in_model_decode"] = phases.decode_s
        return out

    def refused(self, error: RouterError) -> None:
        self._count("failed" if error.status >= 500 else "refused",
                    str(error.code or error.type))

    def cancelled(self) -> None:
        self._count("cancelled", "client")

    def _count(self, outcome: str, reason: str) -> None:
        if self._is_done:  # one outcome per request
            return
        self._is_done = True
        self.metrics.inc("fairserve_requests", (self.tenant, outcome, reason))
        if self.span.is_recording():
            self.span.set_attribute("fairserve.outcome", outcome)
