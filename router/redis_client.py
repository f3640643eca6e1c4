"""The async Redis client every fairserve process uses.

redis-py's asyncio connection packs commands in pure Python, one encode call per argument; a
batched script call has hundreds of arguments, and packing them cost a dispatcher more CPU than
the server spent running the script. With hiredis installed (a dependency) the packing is done
by ``hiredis.pack_command`` in C; anything it refuses goes through redis-py's own packer, so the
errors for bad arguments stay redis-py's.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import hiredis
import redis.asyncio as aioredis


class PackedConnection(aioredis.Connection):
    """A TCP connection whose commands are packed by hiredis."""

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0]
        # a command name with literal arguments ("CONFIG GET") is sent as separate arguments
        split = head.split() if isinstance(head, str | bytes) else [head]
        try:
            return [hiredis.pack_command((*split, *args[1:]))]
        except TypeError:
            return super().pack_command(*args)


POOL_WAIT_S = 10.0  # how long a command waits for a free connection of a bounded pool


def connect(url: str, max_connections: int | None = None, **kwargs: Any) -> aioredis.Redis:
    """An async client for ``url``; plain ``redis://`` connections pack with hiredis.

    With ``max_connections`` the pool is bounded and blocking: a burst of requests waits for a
    connection (up to ``POOL_WAIT_S``) instead of failing with "Too many connections".
    """
    if urlparse(url).scheme == "redis" and "connection_class" not in kwargs:
        kwargs["connection_class"] = PackedConnection
    if max_connections is None:
        return aioredis.from_url(url, **kwargs)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=POOL_WAIT_S, **kwargs)
    return aioredis.Redis.from_pool(pool)
