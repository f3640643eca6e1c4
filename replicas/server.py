"""The model replica: a Ray Serve deployment hosting one engine.

Dispatchers call ``generate`` through a streaming deployment handle with a ``ReplicaCall`` (the
prompt's token ids, counted and reserved by the router, sampling parameters, and the response
stream its output goes to). The tokens go straight into that stream, one script call per engine
step for every call the replica runs, through the stream sink it was given; over Ray the call
yields only ``CallReport``s (who has it, that it is alive, each choice's end, or why it
stopped), encoded by their codec (``replicas/protocol``: the router does not import the
engine). The engine is injected by a factory so tests can host a tiny model; what the replica
does in the router's structures (the response streams, its load report) and its tracing setup
are injected too (``replicas.protocol.ReplicaServices``: the router's code, bound by
``cluster/app.py``), so this package imports nothing of the router. ``check_health`` fails
when the engine loop is dead or stuck, so Ray Serve replaces the replica. Every
``report_interval_s`` the replica publishes its load report. On shutdown it withdraws its
report first (no more grants for it) and lets running requests finish within Ray Serve's
graceful shutdown timeout; whatever is cut off then is requeued by its dispatcher (the stream
breaks before the first token) or ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, fields
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
from replicas.engine.sampling_params import SamplingParams
from replicas.protocol import (
    PUBLISHED_ADAPTERS,
    PUBLISHED_BLOCKS,
    PUBLISHED_VERSION,
    CallReport,
    CallSampling,
    CallScheduling,
    ChunkUsage,
    LogprobWire,
    ReplicaCall,
    ReplicaLoad,
    ReplicaServices,
)
from replicas.tracing import record_engine_spans

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0
AUTOSCALE_WINDOW_S = 5.0  # tokens/s for the autoscaler: over the last 5 s of work
AUTOSCALE_MIN_SPAN_S = 1.0
DRAIN_POLL_S = 0.1
# A running call that makes chunks tells its dispatcher it is alive this often, at least: each
# report is an item of a Ray stream, ~0.6 ms of the router's CPU (once a second for every call
# was a quarter of its CPU per token at 32 streams). Half the relay's default stall timeout
# (10 s): within it the relay needs nothing else; past it (a slow step, a lower setting) it reads
# the replica's step count in Redis, so no setting makes a live call look stalled.
HEARTBEAT_S = 5.0


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    engine: EngineConfig
    max_ongoing_requests: int
    report_interval_s: float = 0.5
    drain_timeout_s: float = 20.0


EngineFactory = Callable[[EngineConfig], Engine]


class ModelReplica:
    async def __init__(self, options: ReplicaOptions,  # type: ignore[misc]  # Ray Serve awaits it
                       services: ReplicaServices,
                       engine_factory: EngineFactory | None = None) -> None:
        self.options = options
        self.engine: Engine = (engine_factory or make_engine)(options.engine)
        await self.engine.start()
        self.replica_id = _replica_id()
        self.node = services.node_name()
        self.tracing = services.tracing("fairserve-replica")
        self._num_ongoing = 0
        self._output_marks: list[tuple[float, int]] = []  # (time, output tokens), recent
        self._token_marks: list[tuple[float, int]] = []  # (time, prompt + output tokens)
        self._remaining: dict[str, int] = {}  # request id -> tokens still to process
        self.writer = services.stream_sink()
        self._reporter = services.load_publisher(self.load_report, options.report_interval_s)
        await self._reporter.report()
        self._report_task = asyncio.create_task(self._reporter.run())
        logger.info("replica %s ready", self.replica_id)

    async def generate(self, call: ReplicaCall) -> AsyncGenerator[tuple[Any, ...], None]:
        """Run the call, its chunks written to its response stream; yields its ``CallReport``s,
        each ``encode``d (the router decodes them)."""
        request = GenerateRequest(
            request_id=call.request_id,
            sampling=_sampling_params(call.sampling),
            prompt_token_ids=call.prompt_token_ids,
            arrival_time_s=time.time(),
            resume=tuple(ChoiceResume(r.index, r.token_ids, r.num_text_chars_sent,
                                      r.is_finished) for r in call.resume),
            scheduling=_scheduling(call.scheduling),
            cache_salt=call.cache_salt,
            adapter=call.adapter.name if call.adapter is not None else None,
            adapter_path=call.adapter.path if call.adapter is not None else None,
        )
        # who has the request, at once: the dispatcher watches this replica's heartbeat
        yield CallReport(self.replica_id).encode()
        self._num_ongoing += 1
        num_prompt = len(request.prompt_token_ids or ())
        self._remaining[request.request_id] = (num_prompt + request.sampling.n
                                               * request.sampling.max_tokens)
        # each choice's output tokens in the stream: what its client had, then what follows
        positions = {r.index: len(r.token_ids) for r in call.resume}
        is_prefilled = False
        reported_s = time.monotonic()
        try:
            async for chunk in self.engine.generate(request):
                now = time.monotonic()
                if chunk.token_ids:
                    self._output_marks.append((now, len(chunk.token_ids)))
                    done = len(chunk.token_ids) + (0 if is_prefilled else num_prompt)
                    is_prefilled = True
                    self._token_marks.append((now, done))
                    self._remaining[request.request_id] -= done
                halted = await self._write(call, chunk, positions)
                if halted is not None:
                    yield CallReport(halted=halted).encode()
                    return
                if chunk.finish_reason is not None:
                    if chunk.index == 0:
                        self._trace(call.trace, chunk)  # the trace follows the first choice
                    yield final_report(chunk, positions.get(chunk.index, 0),
                                       self.replica_id).encode()
                    reported_s = now
                elif now - reported_s >= HEARTBEAT_S:
                    yield CallReport().encode()
                    reported_s = now
        finally:
            self._num_ongoing -= 1
            self._remaining.pop(request.request_id, None)

    async def _write(self, call: ReplicaCall, chunk: Chunk, positions: dict[int, int]
                     ) -> str | None:
        """The chunk into the call's response stream; why the call must stop, or None."""
        if not (chunk.token_ids or chunk.text or chunk.finish_reason is not None):
            return None
        position = 0  # a chunk without tokens is not fenced
        if chunk.token_ids:
            position = positions[chunk.index] = (positions.get(chunk.index, 0)
                                                 + len(chunk.token_ids))
        logprobs: list[LogprobWire] | None = None if chunk.logprobs is None else [
            [lp.token_id, lp.logprob, [[t, p] for t, p in lp.top]] for lp in chunk.logprobs]
        return await self.writer.write(
            call.stream, chunk.text, chunk.token_ids, position, logprobs, chunk.index,
            chunk.finish_reason.value if chunk.finish_reason is not None else None)

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
            progress=load.progress,
            compute=load.compute,
            node=self.node,
            adapters=load.adapters,
            model=self.options.engine.served_model_name,
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """For Ray Serve's request routers (``router/dispatch/prefix_affinity.py``): the hashes
        of the blocks this replica's prefix cache holds, and their version."""
        cached = self.engine.cached_prefix()
        return {PUBLISHED_VERSION: cached.version, PUBLISHED_BLOCKS: list(cached.block_hashes),
                PUBLISHED_ADAPTERS: list(self.engine.load().adapters)}

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
        self._report_task.cancel()
        await self._reporter.withdraw(self.replica_id)
        deadline = time.monotonic() + self.options.drain_timeout_s
        while self._num_ongoing and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.engine.shutdown()
        await self.writer.close()
        self.tracing.shutdown()  # flushes the spans not exported yet


def _sampling_params(sampling: CallSampling) -> SamplingParams:
    """The call's sampling as the engine's parameters (the same fields, checked)."""
    return SamplingParams(**{f.name: getattr(sampling, f.name) for f in fields(sampling)})


def _scheduling(raw: CallScheduling | None) -> SchedulingHints | None:
    """The router's scheduling hints (tenant, priority class, weight); None if it sent none."""
    if raw is None:
        return None
    return SchedulingHints(raw.key, raw.priority, raw.weight)


def final_report(chunk: Chunk, position: int, replica_id: str) -> CallReport:
    """A choice's end, once its last chunk is in the stream: where the choice stands there,
    the engine's usage and timings, and the replica that made it."""
    usage = chunk.usage
    return CallReport(
        replica_id, chunk.index, chunk.finish_reason.value if chunk.finish_reason else None,
        position,
        None if usage is None else ChunkUsage(usage.num_prompt_tokens, usage.num_output_tokens,
                                              usage.num_cached_tokens),
        chunk.timings)  # the engine's Timings are the protocol's ChunkTimings


def _replica_id() -> str:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:  # outside Ray Serve
        return uuid.uuid4().hex[:12]
