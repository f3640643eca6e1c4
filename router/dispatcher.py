"""The dispatcher: a loop in every router replica that grants queued requests to replicas.

One loop step: wait to be woken (an admission on any router publishes on the wake channel; a
local admission or completion sets an event; a short poll catches the rest), reap expired
leases now and then, read the replicas' capacity, and call the grant script with it. Each
grant runs as its own task: it streams the request through a replica, appends the chunks to
the request's response stream (the reader may be on another router), renews the lease, watches
for a cancel, and completes the request, settling its reservation.

Failures: a replica that dies or cannot be reached before the first token is the dispatcher's
problem, not the client's: the request is requeued (head of its queue, fairness credit back)
and runs again, dead-lettered after ``max_deliveries``. After the first token the request ends
with an error event (resuming on another replica from the tokens sent is not built yet). A
replica that refuses the request ends it with that error. A dispatcher that loses its lease
(it stalled past the deadline and the reaper took the request back) drops the stream; the new
holder owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.trace import Span, Status, StatusCode
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from router import response_events
from router.capacity import CapacityView
from router.errors import (
    LeaseLostError,
    ReplicaFailedError,
    ReplicaUnavailableError,
    RouterError,
)
from router.messages import Grant, Lease, RequestState
from router.prompt_tokenizer import PromptTokenizer
from router.queues import TenantQueues
from router.streams import AppendBatcher, ResponseStreams
from router.tracing import (
    OFF,
    QueueFacts,
    Tracing,
    carrier,
    context_of,
    decode_meta,
    now_ns,
    record_queue_span,
    start_dispatch_span,
)

logger = logging.getLogger(__name__)


class DispatchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    poll_s: float = Field(0.2, gt=0, le=10, description="longest wait between grant attempts")
    renew_s: float = Field(
        3.0, gt=0, le=60,
        description="lease renewal period; also how soon a cancel from another router reaches "
        "a request that has produced no token yet (every appended chunk also reports it)",
    )
    reap_s: float = Field(1.0, gt=0, le=60, description="how often this dispatcher reaps leases")
    capacity_refresh_s: float = Field(
        0.25, gt=0, le=10, description="how often the replicas' load reports are re-read"
    )


class ReplicaStream(Protocol):
    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    def cancel(self) -> None: ...


class ReplicaPool(Protocol):
    """How a dispatcher reaches the replicas (a Ray Serve handle in the cluster)."""

    def generate(self, call: dict[str, Any]) -> ReplicaStream:
        """Start one request; iterating yields wire chunks. Raises ``ReplicaUnavailableError``
        or ``ReplicaFailedError`` while iterating."""
        ...


@dataclass(slots=True)
class _Running:
    grant: Grant
    granted_ns: int
    admitted_ns: int
    span: Span | None = None
    stream: ReplicaStream | None = None
    is_cancel_requested: bool = False
    num_output_tokens: int = 0  # all choices together
    prompt_tokens: int = 0
    num_choices: int = 1
    finals: dict[int, dict[str, Any]] = field(default_factory=dict)  # choice -> its last wire


class Dispatcher:
    def __init__(self, queues: TenantQueues, replicas: ReplicaPool, tokenizer: PromptTokenizer,
                 holder: str, settings: DispatchSettings | None = None,
                 tracing: Tracing = OFF) -> None:
        self.queues = queues
        self.streams = ResponseStreams(queues.scripts)
        self.appends = AppendBatcher(self.streams)
        self.tracing = tracing
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.holder = holder
        self.settings = settings or DispatchSettings()
        self.capacity = CapacityView(queues.client, self.settings.capacity_refresh_s)
        self._wake = asyncio.Event()
        self._running: dict[str, _Running] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_reap = 0.0

    # ---- the loop ----

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
            self._wake.clear()
            try:
                await self._step()
            except RouterError as exc:
                logger.error("dispatch step failed: %s", exc.message)
                await asyncio.sleep(self.settings.poll_s)
            except (RedisError, OSError) as exc:  # Redis away: keep trying
                logger.error("dispatch step failed, Redis unreachable: %s", exc)
                await asyncio.sleep(self.settings.poll_s)

    async def _step(self) -> None:
        if time.monotonic() - self._last_reap >= self.settings.reap_s:
            self._last_reap = time.monotonic()
            reaped = await self.queues.reap()
            if reaped.num_requeued or reaped.num_dead:
                logger.warning("reaper: %d requeued, %d dead-lettered", reaped.num_requeued,
                               reaped.num_dead)
        slots = await self.capacity.total_slots()
        if slots <= 0:
            return
        batch = await self.queues.grant(self.holder, slots, capacity=slots)
        granted_ns = now_ns()
        for grant in batch.grants:
            task = asyncio.create_task(self._serve(grant, granted_ns),
                                       name=f"dispatch {grant.request_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if len(batch.grants) >= self.queues.settings.max_grants_per_call:
            self._wake.set()  # more may be waiting

    async def shutdown(self) -> None:
        """Stop serving: running requests are handed back to their queues."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- local cancellation (a client of this router hung up) ----

    def abort_local(self, request_id: str) -> bool:
        running = self._running.get(request_id)
        if running is None:
            return False
        running.is_cancel_requested = True
        if running.stream is not None:
            running.stream.cancel()
        return True

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- one request ----

    async def _serve(self, grant: Grant, granted_ns: int) -> None:
        meta = decode_meta(grant.meta)
        admitted_ns = int(meta.get("admitted_ns") or grant.created_ms * 1_000_000)
        running = _Running(grant, granted_ns, admitted_ns, prompt_tokens=grant.prompt_tokens)
        running.span = self._start_spans(running, meta)
        self._running[grant.request_id] = running
        renewer = asyncio.create_task(self._renew(running))
        try:
            await self._run_on_replica(running)
        except LeaseLostError as exc:
            logger.warning("dropped %s: %s", grant.request_id, exc.message)
            _end_span(running, "lease_lost", is_error=True)
        except asyncio.CancelledError:  # this router is shutting down: hand the request back
            with contextlib.suppress(RouterError, RedisError, OSError):
                await asyncio.shield(self.queues.requeue(grant.lease, "router shutdown"))
            _end_span(running, "requeued")
            raise
        except (RedisError, OSError) as exc:
            logger.error("lost Redis while serving %s: %s (the reaper will requeue it)",
                         grant.request_id, exc)
            _end_span(running, "redis_lost", is_error=True)
        finally:
            _end_span(running, "ended")
            renewer.cancel()
            if running.stream is not None:
                running.stream.cancel()
            self._running.pop(grant.request_id, None)
            self._wake.set()  # a slot is free

    async def _run_on_replica(self, running: _Running) -> None:
        grant = running.grant
        lease = grant.lease
        body = json.loads(grant.body)
        call = {"request_id": f"{grant.request_id}.{lease.attempt}",
                "prompt_token_ids": body["prompt_token_ids"], "sampling": body["sampling"]}
        running.num_choices = int(body["sampling"].get("n", 1))
        if running.span is not None:
            call["trace"] = carrier(running.span)
        want_logprobs = bool(body["sampling"].get("logprobs"))
        try:
            running.stream = self.replicas.generate(call)
            async for wire in running.stream:
                if running.is_cancel_requested:
                    break
                if await self._relay(running, wire, want_logprobs):
                    return
        except ReplicaUnavailableError as exc:
            if running.num_output_tokens == 0 and not running.is_cancel_requested:
                state = await self.queues.requeue(lease, exc.message)
                logger.warning("replica unavailable for %s: %s; %s", grant.request_id,
                               exc.message, state.value)
                _end_span(running, "requeued")
                return
            await self._fail(running, exc)
            return
        except ReplicaFailedError as exc:
            await self._fail(running, exc)
            return
        await self._end_cancelled(running)
        _end_span(running, "cancelled")

    async def _relay(self, running: _Running, wire: dict[str, Any], want_logprobs: bool) -> bool:
        """Append one chunk; True when it was the last choice's final one and the request is
        completed."""
        ids: list[int] = wire["token_ids"]
        running.num_output_tokens += len(ids)
        logprobs = _logprobs(self.tokenizer, wire.get("logprobs")) if want_logprobs else None
        index, finish = int(wire.get("index", 0)), wire.get("finish_reason")
        # with n > 1 a choice's end travels on its last chunk; one choice ends with the request
        choice_finish = finish if running.num_choices > 1 else None
        if ids or wire["text"] or choice_finish is not None:
            event = response_events.chunk_data(wire["text"], len(ids), logprobs, index,
                                               choice_finish)
            status = await self.appends.append(running.grant.lease,
                                               [(response_events.CHUNK, event)])
            if status.is_cancel_requested:
                self.abort_local(running.grant.request_id)
        if finish is None:
            return False
        running.finals[index] = wire
        if len(running.finals) < running.num_choices:
            return False
        await self._complete(running)
        return True

    async def _complete(self, running: _Running) -> None:
        """Every choice has ended: the end event with the usage of all, and the settlement."""
        finals = [running.finals[i] for i in sorted(running.finals)]
        first = finals[0]
        prompt, cached = first["usage"]["prompt_tokens"], first["usage"]["cached_tokens"]
        completion = sum(w["usage"]["completion_tokens"] for w in finals)
        timings = {**_merged_timings([w.get("timings") or {} for w in finals]),
                   "admitted_s": running.admitted_ns / 1e9, "granted_s": running.granted_ns / 1e9}
        reasons = [w["finish_reason"] for w in finals]
        final = response_events.end_data(reasons[0], prompt, completion, cached, timings,
                                         reasons if running.num_choices > 1 else None)
        outcome = (RequestState.CANCELLED if reasons[0] == "abort" else RequestState.COMPLETED)
        await self.queues.complete(running.grant.lease, prompt, completion, reasons[0], final,
                                   outcome)
        if running.span is not None:
            running.span.set_attribute("fairserve.replica.id", str(first.get("replica_id", "")))
            _end_span(running, outcome.value)

    async def _end_cancelled(self, running: _Running) -> None:
        used = running.num_output_tokens
        final = response_events.end_data("abort", running.prompt_tokens, used, 0)
        await self.queues.complete(running.grant.lease, running.prompt_tokens, used, "abort",
                                   final, RequestState.CANCELLED)

    async def _fail(self, running: _Running, error: RouterError) -> None:
        logger.error("request %s failed: %s", running.grant.request_id, error.message)
        _end_span(running, "failed", is_error=True)
        used = running.num_output_tokens
        await self.queues.complete(running.grant.lease, running.prompt_tokens, used, "error",
                                   response_events.error_data(error, running.prompt_tokens, used))

    def _start_spans(self, running: _Running, meta: dict[str, Any]) -> Span | None:
        tracer = self.tracing.tracer
        if tracer is None:
            return None
        grant = running.grant
        parent = context_of(meta)
        if grant.lease.attempt == 1:
            facts = QueueFacts(grant.tenant_id, grant.priority, grant.admit_depth,
                               grant.prompt_tokens + grant.max_tokens)
            record_queue_span(tracer, parent, facts, running.admitted_ns, running.granted_ns)
        return start_dispatch_span(tracer, parent, grant.request_id, self.holder,
                                   grant.lease.attempt, running.granted_ns)

    async def _renew(self, running: _Running) -> None:
        lease: Lease = running.grant.lease
        while True:
            await asyncio.sleep(self.settings.renew_s)
            try:
                status = await self.queues.renew(lease)
            except LeaseLostError:
                logger.warning("lease on %s lost", lease.request_id)
                self.abort_local(lease.request_id)
                return
            except (RedisError, OSError) as exc:
                logger.warning("renewing %s failed: %s", lease.request_id, exc)
                continue
            if status.is_cancel_requested:
                self.abort_local(lease.request_id)


def _end_span(running: _Running, outcome: str, is_error: bool = False) -> None:
    """End the dispatch span once, with how the delivery ended."""
    span, running.span = running.span, None
    if span is None:
        return
    span.set_attribute("fairserve.outcome", outcome)
    if is_error:
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()


def _merged_timings(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine timings of a request from its choices': the earliest start of each phase,
    the last finish, counts added up (one choice: its own)."""
    if len(timings) == 1:
        return timings[0]

    def earliest(name: str) -> float | None:
        values = [t[name] for t in timings if t.get(name) is not None]
        return min(values) if values else None

    merged: dict[str, Any] = {name: earliest(name)
                              for name in ("arrived_s", "first_scheduled_s", "first_token_s")}
    finished = [t["finished_s"] for t in timings if t.get("finished_s") is not None]
    merged["finished_s"] = max(finished) if finished else None
    for name in ("num_prefill_chunks", "num_preemptions"):
        merged[name] = sum(int(t.get(name, 0)) for t in timings)
    return merged


def _logprobs(tokenizer: PromptTokenizer, raw: list[Any] | None) -> list[Any] | None:
    """Wire logprobs ``[[id, logprob, [[id, logprob], ...]], ...]`` with token texts."""
    if raw is None:
        return None
    return [[tokenizer.piece(tid), lp, [[tokenizer.piece(t), p] for t, p in top]]
            for tid, lp, top in raw]
