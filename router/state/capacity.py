"""Replica capacity, from the load reports replicas write to Redis.

Each replica writes its report (``ReplicaLoad``, through ``router/state/load_report.py``) every
fraction of a second, with a TTL; a replica that stops reporting (dead, or removed) drops out
of the sum within ``keys.REPLICA_REPORT_TTL_S``. Dispatchers pass the sum of the slots to the grant script, which
counts the live leases in the same atomic call, so all dispatchers together never lease more
requests than the replicas take: Ray Serve's handle never has to queue one out of sight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis

from replicas.protocol import ReplicaLoad
from router.state import keys

logger = logging.getLogger(__name__)


async def read_loads(client: aioredis.Redis) -> list[ReplicaLoad]:
    """The live replicas' last reports; stale index entries are pruned."""
    now_ms = int(time.time() * 1000)
    oldest = now_ms - keys.REPLICA_REPORT_TTL_S * 1000
    ids: list[Any] = await client.zrangebyscore(keys.replicas(), oldest, "+inf")
    loads: list[ReplicaLoad] = []
    if ids:
        raws = await client.mget([keys.replica(i.decode()) for i in ids])
        for replica_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue
            try:
                loads.append(ReplicaLoad.from_json(raw))
            except (ValueError, TypeError) as exc:
                logger.warning("malformed load report of replica %s: %s", replica_id, exc)
    await client.zremrangebyscore(keys.replicas(), "-inf", f"({oldest}")
    return loads


class CapacityView:
    """Total replica slots, read at most once per ``refresh_s``; of the replicas of one
    model (``model``, its served name) where given, else of all. A report that names no model
    (a replica of an older version, during a rolling upgrade) counts for the default model
    (``is_default``)."""

    def __init__(self, client: aioredis.Redis, refresh_s: float = 0.25,
                 model: str | None = None, is_default: bool = True) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.model = model
        self.is_default = is_default
        self._loads: list[ReplicaLoad] = []
        self._read_at = 0.0

    async def loads(self) -> list[ReplicaLoad]:
        if time.monotonic() - self._read_at >= self.refresh_s:
            loads = await read_loads(self.client)
            self._loads = loads if self.model is None else [
                load for load in loads if load.model == self.model
                or (not load.model and self.is_default)]
            self._read_at = time.monotonic()
        return self._loads

    async def total_slots(self) -> int:
        return sum(load.max_ongoing for load in await self.loads())
