"""The async Redis client every fairserve process uses, and how to wait until a server is
ready (answering, with its dataset loaded).

redis-py's asyncio connection packs commands in pure Python, one encode call per argument; a
batched script call has hundreds of arguments, and packing them cost a dispatcher more CPU than
the server spent running the script. With hiredis installed (a dependency) the packing is done
by ``hiredis.pack_command`` in C; anything it refuses goes through redis-py's own packer, so the
errors for bad arguments stay redis-py's.

A URL may name Redis Sentinel instead of a server: ``redis+sentinel://[user:password@]host:port
[,host:port...]/<service>[/<db>]`` (the sentinels' addresses, the monitored primary's name). The
client asks the sentinels for the primary before it connects and again after a connection
fails, so after a failover it follows the new primary by itself (redis-py's Sentinel pool);
the user and password are the data servers' (the sentinels are asked without one).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlparse, urlsplit, urlunsplit

import hiredis
import redis
import redis.asyncio as aioredis
import redis.sentinel
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


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


class PackedSentinelConnection(SentinelManagedConnection):
    """A connection to the primary a Sentinel names, packed by hiredis."""

    pack_command = PackedConnection.pack_command


class BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A bounded Sentinel pool whose callers wait for a free connection (as ``connect``'s)."""


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelAddress:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None


def sentinel_address(url: str) -> SentinelAddress:
    """The parts of a ``redis+sentinel://`` URL; ValueError for a malformed one."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL")
    sentinels = []
    for hostport in parts.netloc.rpartition("@")[2].split(","):
        host, colon, port = hostport.rpartition(":")
        if not colon:
            host, port = hostport, str(SENTINEL_PORT)
        if not host or not port.isdigit():
            raise ValueError(f"a sentinel address is host:port, not {hostport!r}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{SENTINEL_SCHEME}:// URLs end in /<service>[/<db>], not {parts.path!r}")
    return SentinelAddress(tuple(sentinels), path[0], int(path[1]) if len(path) == 2 else 0,
                           unquote(parts.username) if parts.username else None,
                           unquote(parts.password) if parts.password is not None else None)


def sync_connect(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for ``url`` (plain or Sentinel), for the CLI and the autoscaler."""
    if urlparse(url).scheme != SENTINEL_SCHEME:
        return redis.Redis.from_url(url, **kwargs)
    address = sentinel_address(url)
    sentinel = redis.sentinel.Sentinel(
        list(address.sentinels), socket_timeout=kwargs.get("socket_timeout"),
        socket_connect_timeout=kwargs.get("socket_connect_timeout"))
    return sentinel.master_for(address.service, db=address.db, username=address.username,
                               password=address.password, **kwargs)


POOL_WAIT_S = 10.0  # how long a command waits for a free connection of a bounded pool
PASSWORD_ENV = "FAIRSERVE_REDIS__PASSWORD"
PASSWORD_FILE_ENV = "FAIRSERVE_REDIS__PASSWORD_FILE"  # a mounted Secret: the better way
USERNAME_ENV = "FAIRSERVE_REDIS__USERNAME"  # a Redis ACL user (the chart: one per role)


def with_password(url: str, password: str | None, username: str | None = None) -> str:
    """``url`` with ``password`` (and ``username``, when the URL names none) in it, unless the
    URL has a password of its own."""
    parts = urlsplit(url)
    if not password or parts.password is not None:
        return url
    name = parts.username or username
    user = quote(name, safe="") if name else ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def password_of(password: str | None, password_file: str | None) -> str | None:
    """The password given, else the contents of ``password_file`` (trailing newline dropped)."""
    if password:
        return password
    if password_file:
        with open(password_file) as f:
            return f.read().rstrip("\r\n") or None
    return None


def with_env_password(url: str) -> str:
    """``url`` with the password of this process's environment: ``FAIRSERVE_REDIS__PASSWORD``,
    or the file ``FAIRSERVE_REDIS__PASSWORD_FILE`` names (a mounted Kubernetes Secret), as the
    ACL user ``FAIRSERVE_REDIS__USERNAME`` when that is set (else Redis's default user).

    NOTE: the Redis password never travels through Ray. Deployment arguments, autoscaling
    policy arguments and serveConfigV2 are visible on the Ray dashboard (and the last in the
    RayService), so they carry the URL without it, and every process that connects (router,
    replica, autoscaling policy) adds it from its own environment, which Kubernetes fills from
    a Secret."""
    return with_password(url, password_of(os.environ.get(PASSWORD_ENV),
                                          os.environ.get(PASSWORD_FILE_ENV)),
                         os.environ.get(USERNAME_ENV) or None)


def connect(url: str, max_connections: int | None = None, **kwargs: Any) -> aioredis.Redis:
    """An async client for ``url`` (``redis://`` or ``redis+sentinel://``), packing with
    hiredis.

    With ``max_connections`` the pool is bounded and blocking: a burst of requests waits for a
    connection (up to ``POOL_WAIT_S``) instead of failing with "Too many connections".
    """
    scheme = urlparse(url).scheme
    if scheme == SENTINEL_SCHEME:
        return _connect_sentinel(sentinel_address(url), max_connections, **kwargs)
    if scheme == "redis" and "connection_class" not in kwargs:
        kwargs["connection_class"] = PackedConnection
    if max_connections is None:
        return aioredis.from_url(url, **kwargs)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=POOL_WAIT_S, **kwargs)
    return aioredis.Redis.from_pool(pool)


def _connect_sentinel(address: SentinelAddress, max_connections: int | None,
                      **kwargs: Any) -> aioredis.Redis:
    sentinel = Sentinel(list(address.sentinels), socket_timeout=kwargs.get("socket_timeout"),
                        socket_connect_timeout=kwargs.get("socket_connect_timeout"))
    pool: dict[str, Any] = {"connection_pool_class": SentinelConnectionPool}
    if max_connections is not None:
        pool = {"connection_pool_class": BlockingSentinelPool,
                "max_connections": max_connections, "timeout": POOL_WAIT_S}
    return sentinel.master_for(  # type: ignore[no-any-return]
        address.service, redis_class=aioredis.Redis, db=address.db, username=address.username,
        password=address.password, connection_class=kwargs.pop(
            "connection_class", PackedSentinelConnection), **pool, **kwargs)


# ---- readiness: a server is ready once its dataset is in memory ----

LOAD_TIMEOUT_S = 600.0  # the longest a restarted Redis may replay its AOF before we give up
LOAD_POLL_S = 0.1
LOAD_REPORT_EVERY_S = 2.0


class RedisNotReadyError(RuntimeError):
    """Redis did not answer, or did not finish loading its data, in time."""


def loading_progress(info: Mapping[str, Any]) -> str | None:
    """``None`` when ``INFO persistence`` says the dataset is loaded (``loading:0``); else how far
    the replay of the AOF/RDB has got. A server answers ``INFO`` while it loads, and ``LOADING``
    errors to almost everything else, so an answer alone does not make it ready."""
    if int(info.get("loading", 0)) == 0:
        return None
    percent = float(info.get("loading_loaded_perc", 0.0))
    eta_s = info.get("loading_eta_seconds")
    return f"loading its data: {percent:.0f}% ({eta_s} s left)"


async def wait_loaded(client: aioredis.Redis, timeout_s: float = LOAD_TIMEOUT_S,
                      progress: Callable[[str], None] | None = None) -> None:
    """Until ``client``'s server answers and has finished loading its dataset.

    ``progress`` is told every ``LOAD_REPORT_EVERY_S`` while the server loads. Raises
    ``RedisNotReadyError`` with the last thing seen after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last_report = 0.0
    seen = "no answer"
    while time.monotonic() < deadline:
        try:
            state = loading_progress(await client.info("persistence"))
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            state = seen = f"unreachable: {exc}"
        else:
            if state is None:
                return
            seen = state
        if progress is not None and time.monotonic() - last_report >= LOAD_REPORT_EVERY_S:
            progress(f"redis: {state}")
            last_report = time.monotonic()
        await asyncio.sleep(LOAD_POLL_S)
    raise RedisNotReadyError(f"Redis not ready after {timeout_s:.0f} s ({seen})")
