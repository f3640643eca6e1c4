"""The model replica: a Ray Serve deployment hosting one engine.

Dispatchers call ``generate`` through a streaming deployment handle with a ``ReplicaCall`` (the
prompt's token ids, counted and reserved by the router, and sampling parameters); it yields
``ReplicaChunk``s encoded by their codec (``replicas/protocol.py``: the router does not import
the engine). The engine is injected by a factory so tests can
host a tiny model. ``check_health`` fails when the engine loop is dead or stuck, so Ray Serve
replaces the replica. Every ``report_interval_s`` the replica writes its load report to Redis.
On shutdown it withdraws its report first (no more grants for it) and lets running requests
finish within Ray Serve's graceful shutdown timeout; whatever is cut off then is requeued by
its dispatcher (the stream breaks before the first token) or ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from replicas.engine.config import EngineConfig
from replicas.engine.factory import make_engine
from replicas.engine.interface import (
    ChoiceResume,
    Chunk,
    Engine,
    GenerateRequest,
    SchedulingHints,
)
from replicas.engine.sampling_params import GuideKind, SamplingParams, StructuredOutput
from replicas.load_report import LoadReporter
from replicas.protocol import (
    PUBLISHED_BLOCKS,
    PUBLISHED_VERSION,
    CallScheduling,
    ChunkUsage,
    ReplicaCall,
    ReplicaChunk,
)
from replicas.tracing import record_engine_spans
from router.state.capacity import ReplicaLoad
from router.telemetry.tracing import configure_tracing

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0
AUTOSCALE_WINDOW_S = 5.0  # tokens/s for the autoscaler: over the last 5 s of work
AUTOSCALE_MIN_SPAN_S = 1.0
DRAIN_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    engine: EngineConfig
    max_ongoing_requests: int
    redis_url: str | None  # None: no load reports (a replica used without the router)
    report_interval_s: float = 0.5
    drain_timeout_s: float = 20.0


EngineFactory = Callable[[EngineConfig], Engine]


class ModelReplica:
    async def __init__(self, options: ReplicaOptions,  # type: ignore[misc]  # Ray Serve awaits it
                       engine_factory: EngineFactory | None = None) -> None:
        self.options = options
        self.engine: Engine = (engine_factory or make_engine)(options.engine)
        await self.engine.start()
        self.replica_id = _replica_id()
        self.tracing = configure_tracing("fairserve-replica")
        self._num_ongoing = 0
        self._output_marks: list[tuple[float, int]] = []  # (time, output tokens), recent
        self._token_marks: list[tuple[float, int]] = []  # (time, prompt + output tokens)
        self._remaining: dict[str, int] = {}  # request id -> tokens still to process
        self._reporter: LoadReporter | None = None
        self._report_task: asyncio.Task[None] | None = None
        if options.redis_url:
            self._reporter = LoadReporter(options.redis_url, self.load_report,
                                          options.report_interval_s)
            await self._reporter.report()
            self._report_task = asyncio.create_task(self._reporter.run())
        logger.info("replica %s ready", self.replica_id)

    async def generate(self, call: ReplicaCall) -> AsyncGenerator[tuple[Any, ...], None]:
        """The call's chunks, each ``ReplicaChunk.encode``d (the router decodes them)."""
        request = GenerateRequest(
            request_id=call.request_id,
            sampling=SamplingParams(**_sampling_args(call.sampling)),
            prompt_token_ids=call.prompt_token_ids,
            arrival_time_s=time.time(),
            resume=tuple(ChoiceResume(r.index, r.token_ids, r.num_text_chars_sent,
                                      r.is_finished) for r in call.resume),
            scheduling=_scheduling(call.scheduling),
        )
        # who has the request, at once: the dispatcher watches this replica's heartbeat
        yield ReplicaChunk((), "", replica_id=self.replica_id).encode()
        self._num_ongoing += 1
        num_prompt = len(request.prompt_token_ids or ())
        self._remaining[request.request_id] = (num_prompt + request.sampling.n
                                               * request.sampling.max_tokens)
        is_prefilled = False
        try:
            async for chunk in self.engine.generate(request):
                if chunk.token_ids:
                    now = time.monotonic()
                    self._output_marks.append((now, len(chunk.token_ids)))
                    done = len(chunk.token_ids) + (0 if is_prefilled else num_prompt)
                    is_prefilled = True
                    self._token_marks.append((now, done))
                    self._remaining[request.request_id] -= done
                if chunk.finish_reason is not None and chunk.index == 0:
                    self._trace(call.trace, chunk)  # the trace follows the first choice
                yield to_wire(chunk, self.replica_id).encode()
        finally:
            self._num_ongoing -= 1
            self._remaining.pop(request.request_id, None)

    def _trace(self, trace_fields: dict[str, str] | None, final: Chunk) -> None:
        tracer = self.tracing.tracer
        if tracer is not None and final.timings is not None and final.usage is not None:
            record_engine_spans(tracer, trace_fields, self.replica_id, final.timings,
                                final.usage)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def load_report(self) -> ReplicaLoad:
        load = self.engine.load()
        return ReplicaLoad(
            replica_id=self.replica_id,
            max_ongoing=self.options.max_ongoing_requests,
            ongoing=self._num_ongoing,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_free_kv_blocks=load.num_free_kv_blocks,
            num_total_kv_blocks=load.num_total_kv_blocks,
            output_tokens_per_s=self._throughput(),
            reported_ms=int(time.time() * 1000),
            num_steps=load.num_steps,
            compute=load.compute,
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """For Ray Serve's request routers (``router/dispatch/prefix_affinity.py``): the hashes
        of the blocks this replica's prefix cache holds, and their version."""
        cached = self.engine.cached_prefix()
        return {PUBLISHED_VERSION: cached.version, PUBLISHED_BLOCKS: list(cached.block_hashes)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For the autoscaling policy (``cluster/autoscaling.py``): the tokens this replica
        still has to process for its running requests (prompts not yet prefilled, output up to
        ``max_tokens``), and the tokens it processed per second over the last window."""
        horizon = time.monotonic() - AUTOSCALE_WINDOW_S
        self._token_marks = [m for m in self._token_marks if m[0] >= horizon]
        marks = self._token_marks
        span_s = max(AUTOSCALE_MIN_SPAN_S, time.monotonic() - marks[0][0]) if marks else 1.0
        return {"inflight_tokens": float(max(0, sum(self._remaining.values()))),
                "tokens_per_s": sum(n for _, n in marks) / span_s if marks else 0.0}

    def _throughput(self) -> float:
        horizon = time.monotonic() - THROUGHPUT_WINDOW_S
        self._output_marks = [m for m in self._output_marks if m[0] >= horizon]
        return round(sum(n for _, n in self._output_marks) / THROUGHPUT_WINDOW_S, 2)

    async def __del__(self) -> None:
        """Graceful shutdown: take no more grants, let running requests finish, stop."""
        if self._report_task is not None:
            self._report_task.cancel()
        if self._reporter is not None:
            await self._reporter.withdraw(self.replica_id)
        deadline = time.monotonic() + self.options.drain_timeout_s
        while self._num_ongoing and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.engine.shutdown()
        self.tracing.shutdown()  # flushes the spans not exported yet


def _sampling_args(raw: dict[str, Any]) -> dict[str, Any]:
    """The router's JSON sampling fields as ``SamplingParams`` arguments."""
    args = dict(raw)
    for name in ("stop", "stop_token_ids"):
        if name in args:
            args[name] = tuple(args[name])
    if "logit_bias" in args:
        args["logit_bias"] = tuple((int(t), float(b)) for t, b in args["logit_bias"])
    if args.get("structured_output") is not None:
        spec = args["structured_output"]
        args["structured_output"] = StructuredOutput(GuideKind(spec["kind"]), spec["schema"])
    return args


def _scheduling(raw: CallScheduling | None) -> SchedulingHints | None:
    """The router's scheduling hints (tenant, priority class, weight); None if it sent none."""
    if raw is None:
        return None
    return SchedulingHints(raw.key, raw.priority, raw.weight)


def to_wire(chunk: Chunk, replica_id: str) -> ReplicaChunk:
    """The engine's chunk as the router reads it; a final one names the replica."""
    if chunk.finish_reason is None and chunk.logprobs is None:  # the common case, kept short
        return ReplicaChunk(chunk.token_ids, chunk.text, index=chunk.index)
    usage = chunk.usage
    return ReplicaChunk(
        chunk.token_ids, chunk.text,
        chunk.finish_reason.value if chunk.finish_reason else None, chunk.index,
        None if chunk.logprobs is None else tuple((lp.token_id, lp.logprob, lp.top)
                                                  for lp in chunk.logprobs),
        None if usage is None else ChunkUsage(usage.num_prompt_tokens, usage.num_output_tokens,
                                              usage.num_cached_tokens),
        chunk.timings,  # the engine's Timings are the protocol's ChunkTimings
        replica_id if chunk.finish_reason is not None else None)


def _replica_id() -> str:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:  # outside Ray Serve
        return uuid.uuid4().hex[:12]
