"""The readers of one router: every client it serves a response stream (or a wait for an answer)
holds a lease in Redis, so that what a tenant has open is counted across routers and what a
dead router had open is let go.

A reader is attached when its request is admitted (in the admission's own script call) or, for
an ``Idempotency-Key`` retry or a ``GET`` resume, by an attach of its own; each kind is counted
per tenant against the tenant's ``max_streams`` or ``max_resumes`` (429 beyond). The router
renews the leases of its open readers in one ``ZADD XX`` per ``RENEW_S``; when a client goes
away, or its stream ends, its reader is detached. A router that crashed stops renewing: once
a lease runs out (``keys.READER_LEASE_S``), a dispatcher's sweep detaches its reader as a
disconnect would, so the request is cancelled after its grace period unless a client resumes it,
and the tenant's count comes down. Without leases a crashed router's readers stayed counted for
ever, and its requests could never be cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from redis.exceptions import RedisError

from router.messages import Reader, ReaderKind
from router.state import keys
from router.state.queues import TenantQueues

logger = logging.getLogger(__name__)

RENEW_S = keys.READER_LEASE_S / 3  # two renewals may fail before a lease runs out
SWEEP_BATCH = 100  # leases let go per script call


def lease_end_ms(now_s: float | None = None) -> int:
    """When a lease taken or renewed now runs out (epoch ms)."""
    return int(((time.time() if now_s is None else now_s) + keys.READER_LEASE_S) * 1000)


class ReaderLeases:
    def __init__(self, queues: TenantQueues, grace_ms: int) -> None:
        self.queues = queues
        self.grace_ms = grace_ms  # how long a request nobody reads goes on (api.detach_grace_s)
        self._open: dict[str, Reader] = {}  # member -> reader, of this router's clients

    def new(self, tenant_id: str, request_id: str, kind: ReaderKind) -> Reader:
        return Reader(tenant_id, request_id, secrets.token_hex(8), kind)

    def admitted(self, reader: Reader) -> None:
        """``reader`` was attached by its request's admission."""
        self._open[reader.member] = reader

    async def attach(self, reader: Reader) -> None:
        await self.queues.attach(reader, lease_end_ms())
        self._open[reader.member] = reader

    async def detach(self, reader: Reader) -> None:
        """The client went away or its stream ended: counted down; a request still to run that
        nobody reads any more is cancelled after the grace period unless a client resumes it."""
        self._open.pop(reader.member, None)
        await self.queues.detach(reader, int(time.time() * 1000) + self.grace_ms)

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def renew(self) -> None:
        await self.queues.renew_readers(list(self._open), lease_end_ms())

    async def run(self) -> None:
        """Every ``RENEW_S``: renew this router's leases, and let go of any router's that ran
        out (every router sweeps; the script lets each lease go once)."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await self.renew()
                while await self.queues.sweep_readers(self.grace_ms, SWEEP_BATCH) >= SWEEP_BATCH:
                    pass
            except (RedisError, OSError) as exc:  # the next round tries again
                logger.warning("renewing %d reader leases failed: %s", len(self._open), exc)
