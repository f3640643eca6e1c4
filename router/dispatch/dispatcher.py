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
import logging
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.trace import Span
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from replicas.protocol import context_of
from router.dispatch.relay import (
    Relay,
    RelaySettings,
    ReplicaPool,
    Running,
    end_span,
    lose_lease,
)
from router.dispatch.streams import ResponseStreams
from router.errors import LeaseLostError, RouterError
from router.messages import Grant, Lease
from router.state.capacity import CapacityView
from router.state.queues import TenantQueues
from router.telemetry.tracing import (
    OFF,
    QueueFacts,
    Tracing,
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
    max_migrations: int = Field(
        3, ge=0, le=20, description="times one request may move to another replica when the "
        "one running it dies, stalls or drains (router/dispatch/relay.py); 0: never")
    stall_timeout_s: float = Field(
        10.0, gt=0, le=600, description="no chunk for this long and no engine progress "
        "(steps, model layers) on its replica (its heartbeat in Redis): the replica counts as "
        "stalled and the request moves")

    def relay_settings(self) -> RelaySettings:
        return RelaySettings(max_migrations=self.max_migrations,
                             stall_timeout_s=self.stall_timeout_s,
                             stall_check_s=min(1.0, self.stall_timeout_s / 2))


class Dispatcher:
    """Grants the requests of one model's pool (``pool``; "": the default model's) to this
    router, as many as that model's replicas (those reporting ``model``, its served name; None:
    every replica) have slots free, and serves each; its spans name the model. ``reaps``: this one also requeues the expired leases of
    every pool (one dispatcher per router does)."""

    def __init__(self, queues: TenantQueues, replicas: ReplicaPool, holder: str, settings: DispatchSettings | None = None,
                 tracing: Tracing = OFF,
                 on_migration: Callable[[str, str], None] = lambda tenant, reason: None,
                 pool: str = "", model: str | None = None, reaps: bool = True) -> None:
        self.queues = queues
        self.pool = pool
        self.reaps = reaps
        self.streams = ResponseStreams(queues.scripts)
        self.tracing = tracing
        self.replicas = replicas
        self.holder = holder
        self.settings = settings or DispatchSettings()
        self.model = model
        self.capacity = CapacityView(queues.client, self.settings.capacity_refresh_s, model,
                                     is_default=not pool)
        self._wake = asyncio.Event()
        self.relay = Relay(queues, self.streams, replicas, tracing,
                           self.settings.relay_settings(), on_migration)
        self._running: dict[str, Running] = {}
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
        if self.reaps and time.monotonic() - self._last_reap >= self.settings.reap_s:
            self._last_reap = time.monotonic()
            reaped = await self.queues.reap()
            if reaped.num_requeued or reaped.num_dead:
                logger.warning("reaper: %d requeued, %d dead-lettered", reaped.num_requeued,
                               reaped.num_dead)
            num_cancelled = await self.queues.reap_detached()
            if num_cancelled:
                logger.info("cancelled %d requests nobody read for the grace period",
                            num_cancelled)
        slots = await self.capacity.total_slots()
        if slots <= 0:
            return
        batch = await self.queues.grant(self.holder, slots, capacity=slots, pool=self.pool)
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
        _abort(running)
        return True

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- one request ----

    async def _serve(self, grant: Grant, granted_ns: int) -> None:
        meta = decode_meta(grant.meta)
        admitted_ns = int(meta.get("admitted_ns") or grant.created_ms * 1_000_000)
        running = Running(grant, granted_ns, admitted_ns)
        running.span = self._start_spans(running, meta)
        self._running[grant.request_id] = running
        renewer = asyncio.create_task(self._renew(running))
        try:
            await self.relay.run(running)
        except LeaseLostError as exc:
            logger.warning("dropped %s: %s", grant.request_id, exc.message)
            end_span(running, "lease_lost", is_error=True)
        except asyncio.CancelledError:  # this router is shutting down: hand the request back
            # (its next holder resumes it from the response stream: router/dispatch/relay.py)
            with contextlib.suppress(RouterError, RedisError, OSError):
                await asyncio.shield(self.queues.requeue(grant.lease, "router shutdown",
                                                         is_holder_stopping=True))
            end_span(running, "requeued")
            raise
        except (RedisError, OSError) as exc:
            logger.error("lost Redis while serving %s: %s (the reaper will requeue it)",
                         grant.request_id, exc)
            end_span(running, "redis_lost", is_error=True)
        finally:
            end_span(running, "ended")
            renewer.cancel()
            if running.stream is not None:
                running.stream.cancel()
            # NOTE: this router may hold the request again already (its lease lapsed, the
            # reaper queued it, this router was granted it: attempt 2): that entry is not ours
            if self._running.get(grant.request_id) is running:
                del self._running[grant.request_id]
            self._wake.set()  # a slot is free

    def _start_spans(self, running: Running, meta: dict[str, Any]) -> Span | None:
        tracer = self.tracing.tracer
        if tracer is None:
            return None
        grant = running.grant
        parent = context_of(meta)
        if grant.lease.attempt == 1:
            facts = QueueFacts(grant.tenant_id, grant.priority, grant.admit_depth,
                               grant.prompt_tokens + grant.max_tokens)
            record_queue_span(tracer, parent, facts, running.admitted_ns, running.granted_ns)
        span = start_dispatch_span(tracer, parent, grant.request_id, self.holder,
                                   grant.lease.attempt, running.granted_ns)
        if self.model is not None:
            span.set_attribute("fairserve.model", self.model)
        return span

    async def _renew(self, running: Running) -> None:
        lease: Lease = running.grant.lease
        while True:
            await asyncio.sleep(self.settings.renew_s)
            try:
                status = await self.queues.renew(lease)
            except LeaseLostError:
                logger.warning("lease on %s lost", lease.request_id)
                lose_lease(running)  # this attempt's, not a later one this router holds
                return
            except (RedisError, OSError) as exc:
                logger.warning("renewing %s failed: %s", lease.request_id, exc)
                continue
            if status.is_cancel_requested:
                _abort(running)


def _abort(running: Running) -> None:
    """Stop serving one attempt of a request at its client's cancel: its call is cancelled,
    and it ends as cancelled."""
    running.is_cancel_requested = True
    if running.stream is not None:
        running.stream.cancel()
