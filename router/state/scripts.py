"""The Lua scripts of ``router/state/scripts/``: loaded with SCRIPT LOAD, run with EVALSHA.

Each script is a table of constants (the key templates and TTLs of ``router/state/keys.py``),
``_lib.lua``, and the script's own file, so key names are spelled once and shared transitions
(requeue, refunds, fair-share tags) are written once. Constants in the source, not a decoded
ARGV, because decoding them on every call cost a third of a grant. A server that lost its script cache (a restart)
answers NOSCRIPT; the script is loaded again and the call repeated, which is safe because a
script that was not found did not run.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aioredis

from router.errors import (
    InvalidRequestError,
    NotFoundError,
    RouterError,
    StoredDataError,
    StoreFullError,
)
from router.state import keys


class Script(enum.StrEnum):
    ADMIT = "admit"
    GRANT = "grant"
    RENEW = "renew"
    COMPLETE = "complete"
    REQUEUE = "requeue"
    REAP = "reap"
    CANCEL = "cancel"
    APPEND = "append"
    WRITER = "writer"
    TENANT_PUT = "tenant_put"
    KEY_CREATE = "key_create"
    KEY_REVOKE = "key_revoke"
    BACKLOG = "backlog"
    READERS = "readers"
    ADAPTER_PUT = "adapter_put"


def _lua_constants(overrides: dict[str, str | int] | None = None) -> str:
    """``K``: every constant by name, as a Lua string (Redis converts a Lua number argument with
    snprintf, which cost as much as the command it was passed to); ``KP``: each key template
    split at its ``%s`` placeholders, for ``key()`` in ``_lib.lua`` to join (a concatenation is
    a few times cheaper than string.format)."""
    values = {**keys.SCRIPT_CONSTANTS, **(overrides or {})}
    constants = ", ".join(f"{name} = {json.dumps(str(value))}" for name, value in values.items())
    parts = ", ".join(f"{name} = {{{', '.join(json.dumps(p) for p in value.split('%s'))}}}"
                      for name, value in keys.SCRIPT_CONSTANTS.items()
                      if isinstance(value, str) and "%s" in value)
    return f"local K = {{{constants}}}\nlocal KP = {{{parts}}}\n"


def script_source(script: Script, overrides: dict[str, str | int] | None = None) -> str:
    folder = resources.files("router.state") / "scripts"
    return (_lua_constants(overrides) + (folder / "_lib.lua").read_text() + "\n"
            + (folder / f"{script.value}.lua").read_text())


# Clock: None means the Redis server's own TIME, which every dispatcher shares; tests and
# simulations pass a function returning ms.
Clock = Callable[[], int] | None


class Scripts:
    """Runs fairserve's scripts on one async Redis client."""

    def __init__(self, client: aioredis.Redis, clock: Clock = None,
                 resume_window_s: int = keys.RESUME_WINDOW_S,
                 usage_retention_days: int = keys.USAGE_RETENTION_DAYS) -> None:
        """``resume_window_s``: how long an ended request's record and stream are kept (the
        scripts that end requests write it; ``queues.resume_window_s``);
        ``usage_retention_days``: how long usage records are kept (0: none written)."""
        self.client = client
        self.clock = clock
        overrides = {"resume_window_s": resume_window_s,
                     "usage_ttl_s": usage_retention_days * 86_400}
        self._sources = {script: script_source(script, overrides) for script in Script}
        self._shas: dict[Script, str] = {}

    def _argv(self, args: tuple[Any, ...]) -> list[Any]:
        now = "" if self.clock is None else str(int(self.clock()))
        return [now, *args]

    async def load(self) -> None:
        for script, source in self._sources.items():
            self._shas[script] = await self.client.script_load(source)

    async def run(self, script: Script, *args: Any) -> Any:
        if script not in self._shas:
            await self.load()
        argv = self._argv(args)
        try:
            try:
                return await self.client.evalsha(self._shas[script], 0, *argv)
            except redis.exceptions.NoScriptError:
                await self.load()
                return await self.client.evalsha(self._shas[script], 0, *argv)
        except redis.exceptions.ResponseError as exc:
            raise script_error(exc) from exc

    async def run_many_acked(self, script: Script, calls: list[tuple[Any, ...]], replicas: int,
                             timeout_ms: int) -> tuple[list[Any], int]:
        """One pipeline (no MULTI) of calls of one script, replies in order; with ``replicas`` > 0
        a ``WAIT replicas timeout_ms`` at the end of the same pipeline (so on the connection that
        made the writes, which is what WAIT counts): the replies and how many replicas
        acknowledged them (0 without a WAIT)."""
        if not calls:
            return [], 0
        if script not in self._shas:
            await self.load()
        replies = await self._pipeline(script, calls, replicas, timeout_ms)
        first = next(
            (i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)),
            None,
        )
        if first is not None:  # the calls before it ran; rerun the rest
            await self.load()
            replies = [*replies[:first], *await self._pipeline(script, calls[first:], replicas,
                                                               timeout_ms)]
        acked = 0
        if replicas:
            acked = replies.pop()
            if isinstance(acked, Exception):
                raise acked
        for reply in replies:
            if isinstance(reply, redis.exceptions.ResponseError):
                raise script_error(reply)
        return replies, int(acked)

    async def _pipeline(self, script: Script, calls: list[tuple[Any, ...]], replicas: int = 0,
                        timeout_ms: int = 0) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for args in calls:
            pipe.evalsha(self._shas[script], 0, *self._argv(args))
        if replicas:
            pipe.execute_command("WAIT", replicas, timeout_ms)
        return list(await pipe.execute(raise_on_error=False))


def script_error(exc: redis.exceptions.ResponseError) -> RouterError:
    """The scripts' error replies as router errors; anything else is a server-side failure."""
    text = str(exc)
    code, _, rest = text.partition(" ")
    if code == "FSNOTFOUND":
        what, _, name = rest.partition(" ")
        return NotFoundError(f"unknown {what} {name!r}", param=what)
    if code == "FSSTORED":
        return StoredDataError(f"malformed data in Redis: {rest}")
    if code == "FSINVALID":
        param, _, message = rest.partition(" ")
        return InvalidRequestError(message, param=param)
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or "-OOM " in text:
        # a script's first write refused at maxmemory: it wrote nothing (Redis checks only a
        # script's first write, and the scripts check everything before they write)
        return StoreFullError("used memory > maxmemory")
    return RouterError(f"redis script failed: {text}")
