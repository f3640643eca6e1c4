"""A replica's load report in Redis: what dispatchers, autoscaling and ``top`` read.

The router's code that a replica runs (``replicas.protocol.LoadPublisher``; ``cluster/app.py``
hands it to the replica deployment). The replica knows nothing of tenants, queues or keys; it
only says how busy it is (``replicas.protocol.ReplicaLoad``). The key names come from
``router/state/keys.py`` (the one module that spells Redis keys); the router reads the reports
back in ``router/state/capacity.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from replicas.protocol import ReplicaLoad
from router.state import keys
from router.state.redis_client import connect, with_env_password

logger = logging.getLogger(__name__)


class LoadReporter:
    """``replicas.protocol.LoadPublisher`` on Redis at ``redis_url`` (the password, if any,
    from this process's environment)."""

    def __init__(self, redis_url: str, snapshot: Callable[[], ReplicaLoad],
                 interval_s: float = 0.5) -> None:
        self.client: aioredis.Redis = connect(with_env_password(redis_url), socket_timeout=5)
        self.snapshot = snapshot
        self.interval_s = interval_s

    async def report(self) -> None:
        load = self.snapshot()
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(keys.replica(load.replica_id), load.to_json(), ex=keys.REPLICA_REPORT_TTL_S)
            pipe.zadd(keys.replicas(), {load.replica_id: load.reported_ms})
            await pipe.execute()

    async def run(self) -> None:
        while True:
            try:
                await self.report()
            except (RedisError, OSError) as exc:
                logger.warning("load report failed: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def withdraw(self, replica_id: str) -> None:
        """Stop counting this replica's slots at once (it is shutting down)."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(keys.replica(replica_id))
            pipe.zrem(keys.replicas(), replica_id)
            await pipe.execute()
        await self.client.aclose()
