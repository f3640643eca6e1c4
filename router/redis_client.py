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


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """An async client for ``url``; plain ``redis://`` connections pack with hiredis."""
    if urlparse(url).scheme == "redis" and "connection_class" not in kwargs:
        kwargs["connection_class"] = PackedConnection
    return aioredis.from_url(url, **kwargs)
