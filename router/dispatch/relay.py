"""One granted request on the replicas: called on one, watched to its end, and migrated to
another replica when the one running it dies, hangs or drains.

The tokens do not pass through here. The call names the request's response stream and a
writer (``CallStream``); the replica appends its chunks there itself, one script call per
engine step for all it runs (``router/dispatch/stream_writer.py``), and the router's readers take
them from the stream (``router/dispatch/stream_mux.py``). Over Ray the replica reports only
who has the call, that it is alive, each choice's end (with its usage and timings), or why it
stopped; the relay writes the request's end and settles it (``TenantQueues.complete``).

NOTE: migration. The response stream in Redis is the record of what the client was sent
(``router/dispatch/progress.py`` reads it back); a replica lost mid-stream is not the client's
problem. The relay first names no writer (``ResponseStreams.name_writer``), so the call it
gave up on cannot append once it reads the stream back, even if its replica was only frozen
and thaws later; then it calls a replica again with the same request, a new writer and a
``resume`` per choice: the output tokens already sent (output, not prompt: ``max_tokens``,
``min_tokens``, penalties, seeded draws by position and the grammar all count them) and how
much of their text went out. The engine continues from there and sends only what follows
(``replicas/torch_engine/engine_core.py``); the client sees one unbroken stream, and one usage that
counts each token once. The call also names the replicas the request left (``avoid``), which
the request router passes over while another can take it: a frozen replica looks idle and
holds the prompt's blocks, so it would be chosen again, and Ray Serve drops it only when its
health checks fail, a minute or more later. Appends are also fenced by position
(``router/state/scripts/append.lua``), so a token is never written twice. A request migrates
at most ``max_migrations`` times; after that it ends with an error event (or, if nothing was
sent, goes back to its queue). Each migration is counted (``fairserve_migrations_total``) and
traced (a ``fairserve.migration`` span).

What triggers one: the replica's stream failing (the actor died, was killed at the end of a
graceful drain that outlasted its timeout, or cannot be reached), the replica losing Redis for
longer than it rides out, and a stall. A Ray stream from a frozen process can hang its caller
for ever, so the relay does not trust it to end: a running call reports at least every 5 s
while it makes chunks (``replicas/server.py``, ``HEARTBEAT_S``), and when no report came for
``stall_timeout_s`` it looks, every ``stall_check_s``, at the replica's heartbeat in Redis (its load
report, every ``report_interval_s``, with its engine's progress: steps, and the model layers run
within a step). A replica that stopped reporting, or whose engine has made no progress for
``stall_timeout_s`` while it has work, is stalled: its stream is cancelled and the request
moves. A slow but healthy engine (a long prompt whose chunks each take seconds, a crowded
batch) keeps counting layers and is left alone, however long one step takes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from opentelemetry.trace import Span, Status, StatusCode
from redis.exceptions import RedisError

from replicas.protocol import (
    CallAdapter,
    CallReport,
    CallSampling,
    CallScheduling,
    CallStream,
    Halt,
    ReplicaCall,
    ReplicaLoad,
    carrier,
)
from router.dispatch import response_events
from router.dispatch.progress import Progress
from router.dispatch.streams import ResponseStreams
from router.errors import (
    LeaseLostError,
    ReplicaFailedError,
    ReplicaUnavailableError,
    RouterError,
    StreamGapError,
)
from router.messages import Grant, RequestState, StreamEvent
from router.state import keys
from router.state.queues import TenantQueues
from router.telemetry.tracing import Tracing

logger = logging.getLogger(__name__)
T = TypeVar("T")

ACCEPT_TIMEOUT_S = 180.0  # no replica took the call (all dead, one restarting): then migrate
REDIS_OUTAGE_S = 30.0  # a write to Redis is retried this long (a restart) before giving up
REDIS_RETRY_S = 0.5
MIGRATION_BACKOFF_S = (0.2, 0.5, 1.0, 2.0)
MAX_LEFT = 8  # the replicas a request remembers moving away from


class ReplicaStream(Protocol):
    def __aiter__(self) -> AsyncIterator[CallReport]: ...

    def cancel(self) -> None: ...


class ReplicaPool(Protocol):
    """How a dispatcher reaches the replicas (a Ray Serve handle in the cluster)."""

    def generate(self, call: ReplicaCall) -> ReplicaStream:
        """Start one request; iterating yields its reports. Raises ``ReplicaUnavailableError``
        or ``ReplicaFailedError`` while iterating."""
        ...


@dataclass(frozen=True, slots=True)
class RelaySettings:
    max_migrations: int = 3
    stall_timeout_s: float = 10.0
    stall_check_s: float = 1.0


@dataclass(slots=True)
class Running:
    """A granted request while this dispatcher serves it."""

    grant: Grant
    granted_ns: int
    admitted_ns: int
    span: Span | None = None
    stream: ReplicaStream | None = None
    is_cancel_requested: bool = False
    is_lease_lost: bool = False  # a renewal found the lease gone (see ``lose_lease``)
    progress: Progress = field(default_factory=Progress)
    finals: dict[int, CallReport] = field(default_factory=dict)  # choice -> its end
    migrations: int = 0
    replica_id: str | None = None
    left: list[str] = field(default_factory=list)  # replicas it moved away from, the last few


def lose_lease(running: Running) -> None:
    """A renewal of the request's lease found it gone: its call is cancelled and the attempt
    dropped (``LeaseLostError`` out of ``Relay.run``), never ended as cancelled: the verdict may
    come from a primary a Redis failover is about to demote (split brain), while the lease still
    holds on the new one; the request is then served again once the lease runs out, from what
    its stream holds, and its client never sees an end it did not ask for."""
    running.is_lease_lost = True
    if running.stream is not None:
        running.stream.cancel()


def _leave(running: Running) -> None:
    """The replica the attempt ran on is one the request moves away from: its next call asks
    the request router to pass over it (the NOTE on migration)."""
    if running.replica_id is not None and running.replica_id not in running.left:
        running.left = [*running.left, running.replica_id][-MAX_LEFT:]


def _lease_lost(running: Running) -> LeaseLostError:
    return LeaseLostError(f"lease on {running.grant.request_id!r} lost at its renewal",
                          param="request_id")


class _Stalled(Exception):
    pass


_CANCELLED = "cancelled"  # a call's end: its request's cancel flag went up
# a Redis failover lost the stream's last chunks: it is read back and the tokens made again
_STREAM_GAP = "stream gap: the response stream lost its last chunks (a Redis failover)"


class Relay:
    def __init__(self, queues: TenantQueues, streams: ResponseStreams, replicas: ReplicaPool,
                 tracing: Tracing, settings: RelaySettings,
                 on_migration: Callable[[str, str], None] = lambda tenant, reason: None) -> None:
        self.queues = queues
        self.streams = streams
        self.replicas = replicas
        self.tracing = tracing
        self.settings = settings
        self.on_migration = on_migration
        self.client: aioredis.Redis = queues.client

    async def run(self, running: Running) -> None:
        """Serve the request to its end: completed, cancelled, failed, or given back."""
        grant = running.grant
        body = json.loads(grant.body)
        running.progress = Progress(int(body["sampling"].get("n", 1)))
        if grant.lease.attempt > 1:  # taken over: the client may have tokens already
            await self._read_back(running)
            if running.progress.is_finished:  # all sent; only the end was not written
                await self._complete(running)
                return
        while True:
            reason = await self._attempt(running, body)
            if reason is None:
                return
            await self._read_back(running)
            if running.progress.is_finished:  # all sent; only the end was not written
                await self._complete(running)
                return
            if not await self._may_migrate(running, reason):
                return

    async def _read_back(self, running: Running) -> None:
        """What the client was sent, for sure: no call may write any more (the one that ran
        may still, if it is only frozen), then the response stream read back."""
        grant = running.grant
        await _riding_out_redis(lambda: self.streams.name_writer(grant.lease, ""))
        events = await _riding_out_redis(lambda: _all_events(self.streams, grant))
        running.progress = Progress.from_events(events, running.progress.num_choices)

    async def _attempt(self, running: Running, body: dict[str, Any]) -> str | None:
        """One call to a replica; None when the request ended, else why it must move."""
        grant = running.grant
        lease = grant.lease
        writer = f"{lease.attempt}.{running.migrations}"
        named = await _riding_out_redis(lambda: self.streams.name_writer(lease, writer))
        if named.is_cancel_requested:
            running.is_cancel_requested = True
        call = ReplicaCall(
            request_id=f"{grant.request_id}.{writer}",
            prompt_token_ids=tuple(body["prompt_token_ids"]),
            sampling=CallSampling.from_wire(body["sampling"]),
            stream=CallStream(lease.tenant_id, lease.request_id, lease.holder, lease.attempt,
                              writer),
            # the engine's fair scheduler (replicas/torch_engine/policies.py): whose tokens these are
            scheduling=CallScheduling(grant.tenant_id, grant.priority, grant.weight),
            # each tenant its own prefix-cache partition (or its named group's): no one
            # learns what another sent
            cache_salt=grant.cache_salt,
            resume=running.progress.resume(),
            trace=carrier(running.span) if running.span is not None else None,
            adapter=CallAdapter(*body["adapter"]) if body.get("adapter") else None,
            avoid=tuple(running.left))
        running.replica_id = None
        if call.adapter is not None and running.span is not None:
            running.span.set_attribute("fairserve.lora_adapter", call.adapter.name)
        try:
            reason = _CANCELLED if running.is_cancel_requested else await self._follow(running,
                                                                                     call)
            if reason != _CANCELLED:
                if reason != _STREAM_GAP:  # a Redis failover: the replica was not at fault
                    _leave(running)
                return reason
        except ReplicaUnavailableError as exc:
            _leave(running)
            return f"replica unavailable: {exc.message}"
        except _Stalled as exc:
            _leave(running)
            return f"stalled: {exc}"
        except ReplicaFailedError as exc:
            await self._read_back(running)
            await self._fail(running, exc)
            return None
        await self._read_back(running)
        await self._end_cancelled(running)
        end_span(running, "cancelled")
        return None

    async def _follow(self, running: Running, call: ReplicaCall) -> str | None:
        """The call's reports to its end: None when the request completed, else why it must
        move, or ``_CANCELLED``."""
        stream = running.stream = self.replicas.generate(call)
        async for report in self._watched(running, stream):
            if running.is_lease_lost:
                raise _lease_lost(running)
            if report.halted == Halt.LEASE_LOST:
                raise LeaseLostError(f"lease on {running.grant.request_id!r} lost: the stream "
                                     f"refused the replica's writes", param="request_id")
            if report.halted == Halt.REDIS_UNAVAILABLE:
                stream.cancel()
                return f"redis unavailable: replica {running.replica_id} lost Redis"
            if report.halted == Halt.STREAM_GAP:
                return _STREAM_GAP
            if report.halted == Halt.CANCELLED or running.is_cancel_requested:
                running.is_cancel_requested = True
                return _CANCELLED
            try:
                if report.finish_reason is not None and await self._finished(running, report):
                    return None
            except StreamGapError:  # the last chunks were lost: made again, then completed
                return _STREAM_GAP
        if running.is_lease_lost:
            raise _lease_lost(running)
        return _CANCELLED if running.is_cancel_requested else "stream ended early"

    async def _watched(self, running: Running, stream: ReplicaStream
                       ) -> AsyncIterator[CallReport]:
        """The call's reports, or ``_Stalled`` when its replica stopped making progress."""
        wires: asyncio.Queue[CallReport | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for wire in stream:
                    wires.put_nowait(wire)
                wires.put_nowait(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                wires.put_nowait(exc)

        pumping = asyncio.create_task(pump())
        watch = _Watch(time.monotonic())
        try:
            while True:
                try:  # what is queued already is taken without a timer
                    item = wires.get_nowait() if not wires.empty() else await asyncio.wait_for(
                        wires.get(), self.settings.stall_check_s)
                except TimeoutError:
                    problem = await self._stall(running, watch)
                    if problem is not None:
                        stream.cancel()
                        raise _Stalled(problem) from None
                    continue
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                watch.seen(time.monotonic())
                if item.replica_id:
                    running.replica_id = item.replica_id
                yield item
        finally:
            pumping.cancel()

    async def _stall(self, running: Running, watch: _Watch) -> str | None:
        """Why the replica counts as stalled, or None while it is alive (see the NOTE)."""
        now = time.monotonic()
        if running.replica_id is None:
            waited = now - watch.last_wire_s
            return f"no replica took the call in {waited:.0f} s" \
                if waited > ACCEPT_TIMEOUT_S else None
        if now - watch.last_wire_s < self.settings.stall_timeout_s:
            return None
        raw = await self.client.get(keys.replica(running.replica_id))
        if raw is None:
            return f"replica {running.replica_id} stopped reporting"
        load = ReplicaLoad.from_json(raw)
        if load.progress != watch.progress:
            watch.progress, watch.progress_changed_s = load.progress, now  # slow, but working
            return None
        stuck_s = now - watch.progress_changed_s
        if load.is_busy and stuck_s >= self.settings.stall_timeout_s:
            return f"replica {running.replica_id} made no engine progress in {stuck_s:.0f} s"
        return None

    async def _may_migrate(self, running: Running, reason: str) -> bool:
        grant = running.grant
        if running.is_cancel_requested:
            await self._end_cancelled(running)
            end_span(running, "cancelled")
            return False
        if running.migrations >= self.settings.max_migrations:
            if running.progress.num_tokens == 0:  # nothing sent: back to its queue, credit kept
                state = await self.queues.requeue(grant.lease, reason)
                logger.warning("%s: %s; %s", grant.request_id, reason, state.value)
                end_span(running, "requeued")
            else:
                await self._fail(running, ReplicaUnavailableError(
                    f"the request could not be finished after {running.migrations} migrations "
                    f"({reason})"))
            return False
        running.migrations += 1
        kind = reason.split(":", 1)[0].replace(" ", "_")
        self.on_migration(grant.tenant_id, kind)
        logger.warning("%s: migrating (%d of %d) after %d tokens: %s", grant.request_id,
                       running.migrations, self.settings.max_migrations,
                       running.progress.num_tokens, reason)
        self._trace_migration(running, reason)
        await asyncio.sleep(MIGRATION_BACKOFF_S[min(running.migrations, len(MIGRATION_BACKOFF_S))
                                                - 1])
        return True

    def _trace_migration(self, running: Running, reason: str) -> None:
        tracer = self.tracing.tracer
        if tracer is None or running.span is None:
            return
        from opentelemetry import trace

        context = trace.set_span_in_context(running.span)
        span = tracer.start_span("fairserve.migration", context=context, attributes={
            "fairserve.migration.number": running.migrations,
            "fairserve.migration.reason": reason,
            "fairserve.migration.tokens_sent": running.progress.num_tokens,
            "fairserve.replica.id": running.replica_id or ""})
        span.end()

    async def _finished(self, running: Running, report: CallReport) -> bool:
        """A choice ended (its last chunk is in the stream); True when it was the last open
        one and the request is completed."""
        running.finals[report.index] = report
        running.progress.finish(report.index, report.finish_reason, report.position)
        if not running.progress.is_finished:
            return False
        await self._complete(running)
        return True

    async def _complete(self, running: Running) -> None:
        """Every choice has ended: the end event with the usage of all, and the settlement."""
        progress = running.progress
        finals = [running.finals[i] for i in sorted(running.finals)]
        usages = [w.usage for w in finals if w.usage is not None]
        prompt = usages[0].prompt_tokens if usages else running.grant.prompt_tokens
        cached = usages[0].cached_tokens if usages else 0
        completion = progress.num_tokens  # each token once, whichever replica made it
        timings = {**_merged_timings([asdict(w.timings) if w.timings else {} for w in finals]),
                   "admitted_s": running.admitted_ns / 1e9, "granted_s": running.granted_ns / 1e9}
        reasons = [progress.choice(i).finish_reason or "stop" for i in range(progress.num_choices)]
        final = response_events.end_data(reasons[0], prompt, completion, cached, timings,
                                         reasons if progress.num_choices > 1 else None)
        outcome = RequestState.CANCELLED if reasons[0] == "abort" else RequestState.COMPLETED
        # completed only if the stream holds every token (a Redis failover may have lost some)
        await _riding_out_redis(lambda: self.queues.complete(
            running.grant.lease, prompt, completion, reasons[0], final, outcome,
            completion if outcome == RequestState.COMPLETED else None))
        if running.span is not None:
            running.span.set_attribute("fairserve.replica.id", running.replica_id or "")
            running.span.set_attribute("fairserve.migrations", running.migrations)
            end_span(running, outcome.value)

    async def _end_cancelled(self, running: Running) -> None:
        used = running.progress.num_tokens
        final = response_events.end_data("abort", running.grant.prompt_tokens, used, 0)
        await self.queues.complete(running.grant.lease, running.grant.prompt_tokens, used,
                                   "abort", final, RequestState.CANCELLED)

    async def _fail(self, running: Running, error: RouterError) -> None:
        logger.error("request %s failed: %s", running.grant.request_id, error.message)
        end_span(running, "failed", is_error=True)
        used, prompt = running.progress.num_tokens, running.grant.prompt_tokens
        await self.queues.complete(running.grant.lease, prompt, used, "error",
                                   response_events.error_data(error, prompt, used))


@dataclass(slots=True)
class _Watch:
    """When the relay last heard from the replica, the engine progress its heartbeat last
    showed, and when that count last changed."""

    last_wire_s: float
    progress: int | None = None
    progress_changed_s: float = 0.0

    def seen(self, now: float) -> None:
        self.last_wire_s = now


async def _riding_out_redis(write: Callable[[], Awaitable[T]]) -> T:
    """``write()``, retried while Redis is unreachable (a restart, a failover) for up to
    ``REDIS_OUTAGE_S``; the replica's chunks wait meanwhile (``_watched`` queues them), and
    the positions make a retried append that did land harmless."""
    deadline = time.monotonic() + REDIS_OUTAGE_S
    while True:
        try:
            return await write()
        except (RedisError, OSError) as exc:
            if time.monotonic() > deadline:
                raise
            logger.warning("Redis unreachable (%s); retrying", exc)
            await asyncio.sleep(REDIS_RETRY_S)


async def _all_events(streams: ResponseStreams, grant: Grant) -> list[StreamEvent]:
    """The events a request's stream holds now (no waiting for more)."""
    raw: Any = await streams.client.xrange(keys.stream(grant.tenant_id, grant.request_id))
    return [StreamEvent(event_id.decode(), fields[b"type"].decode(), fields[b"data"].decode())
            for event_id, fields in raw]


def end_span(running: Running, outcome: str, is_error: bool = False) -> None:
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
