"""One blocking XREAD per router for every response stream its clients are waiting on.

A blocking read per waiting client would hold one Redis connection per client: hundreds of
queued requests exhaust any pool (redis-py's default is 100) and Redis' own client limit. The
mux keeps one dedicated connection blocked in ``XREAD ... STREAMS k1 k2 ...`` over all the
streams waited on, and hands each event to the waiters of its stream. A new waiter must be in
the next read: it wakes the blocked one with ``CLIENT UNBLOCK`` (Redis 5+), so it waits for no
timeout. Several waiters may read one stream (an ``Idempotency-Key`` join reads from the start
while the first reader is further on); each has its own position.

A waiter holds at most ``MAX_BUFFERED`` events: one whose client reads slower than its request
is written (a full socket) falls out of the shared read and, once it has taken what it holds,
catches up from the stream itself (XRANGE), then joins the shared read again. The stream in Redis
is the buffer; the router's memory per reader stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.dispatch.streams import START
from router.errors import NotFoundError, OverloadedError, StreamIdleError
from router.messages import RequestState, StreamEvent
from router.state import keys

logger = logging.getLogger(__name__)

READ_BLOCK_MS = 1_000
TICK_S = 1.0  # a waiter that heard nothing this long checks on its stream
READ_BATCH = 512
UNBLOCK_RETRY_S = 0.001
UNBLOCK_RETRIES = 20
RECONNECT_S = 0.5
REDIS_OUTAGE_S = 30.0  # a waiter rides out a Redis restart this long, then fails (503)
MAX_BUFFERED = 256  # events one waiter holds; beyond, it catches up from the stream itself


def _id_key(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class _Waiter:
    last: str
    # events, and None: a tick, when nothing came for a while (``StreamMux._tick``)
    queue: asyncio.Queue[StreamEvent | None] = field(default_factory=asyncio.Queue)
    heard_s: float = field(default_factory=time.monotonic)  # its last event, or tick
    lagging: bool = False  # its buffer filled up: out of the shared read until it catches up

    def take(self) -> list[StreamEvent]:
        """The events queued now, without waiting (ticks among them are dropped)."""
        taken = []
        while not self.queue.empty():
            event = self.queue.get_nowait()
            if event is not None:
                taken.append(event)
        return taken


class StreamMux:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._waiters: dict[str, list[_Waiter]] = {}
        self._changed = asyncio.Event()
        self._reader_id: int | None = None
        self._num_reads = 0  # XREAD calls issued so far
        self._is_blocked = False
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._is_stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stream mux")
        self._ticker = asyncio.create_task(self._tick(), name="stream mux ticks")

    async def stop(self) -> None:
        # redis-py may swallow a cancellation that lands in a blocked read, so the loop also
        # checks a flag, and is woken up to see it
        self._is_stopping = True
        self._changed.set()
        if self._ticker is not None:
            self._ticker.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._task, READ_BLOCK_MS / 1000 * 3)

    async def read(self, tenant_id: str, request_id: str, after: str = "0-0",
                   idle_timeout_s: float | None = None) -> AsyncIterator[StreamEvent]:
        """Events after ``after`` up to and including the terminal one (as
        ``ResponseStreams.read``, but sharing one connection with every other reader)."""
        async for batch in self.read_batches(tenant_id, request_id, after, idle_timeout_s):
            for event in batch:
                yield event

    async def read_batches(self, tenant_id: str, request_id: str, after: str = "0-0",
                           idle_timeout_s: float | None = None
                           ) -> AsyncIterator[list[StreamEvent]]:
        """As ``read``, each time all the events that have arrived (a reader that fell behind
        takes what piled up at once: one write to its client, not one per event)."""
        stream_key = keys.stream(tenant_id, request_id)
        request_key = keys.request(tenant_id, request_id)
        if await self._is_gone(request_key, stream_key):
            raise NotFoundError(f"no request {request_id!r}, or its stream has expired",
                                param="request_id")
        waiter = _Waiter(after)
        self._waiters.setdefault(stream_key, []).append(waiter)
        try:
            await self._wake_reader()
            idle_since = time.monotonic()
            unreachable_since: float | None = None
            while True:
                # NOTE: no timer per wait (asyncio.wait_for made a task and a timer for every
                # event of every stream); a waiter that heard nothing for a while gets a tick
                batch = await self._next(stream_key, waiter)
                if not batch:  # a tick
                    if idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                        raise StreamIdleError(f"request {request_id!r} sent nothing for "
                                              f"{idle_timeout_s:g} s; it goes on: resume it with "
                                              f"GET and Last-Event-ID", param="request_id")
                    try:
                        is_gone = await self._is_gone(request_key, stream_key)
                    except (RedisError, OSError) as exc:  # a restart: wait for it, a while
                        unreachable_since = unreachable_since or time.monotonic()
                        if time.monotonic() - unreachable_since > REDIS_OUTAGE_S:
                            raise OverloadedError(f"the queue store is unavailable: {exc}"
                                                  ) from exc
                        continue
                    unreachable_since = None
                    if is_gone:
                        raise NotFoundError(f"request {request_id!r} expired",
                                            param="request_id") from None
                    continue
                idle_since = time.monotonic()
                batch = batch + waiter.take()
                ends = next((i for i, event in enumerate(batch) if event.is_terminal), None)
                yield batch if ends is None else batch[:ends + 1]
                if ends is not None:
                    return
        finally:
            waiters = self._waiters.get(stream_key, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiters.pop(stream_key, None)

    async def _next(self, stream_key: str, waiter: _Waiter) -> list[StreamEvent]:
        """What a waiter has now, else from its stream if it lags, else the next event; []: a
        tick."""
        batch = waiter.take()
        if not batch and waiter.lagging:
            try:
                batch = await self._catch_up(stream_key, waiter)
            except (RedisError, OSError) as exc:  # a restart or failover: as a tick, which
                logger.warning("catching up %s: %s", stream_key, exc)  # checks on Redis
                return []
        if not batch:
            event = await waiter.queue.get()
            batch = [event] if event is not None else []
        return batch

    async def _catch_up(self, stream_key: str, waiter: _Waiter) -> list[StreamEvent]:
        """The events after a lagging waiter's position, read from its stream; once it has
        them all it joins the shared read again."""
        entries: Any = await self.client.xrange(stream_key, min=f"({waiter.last}",
                                                count=READ_BATCH)
        events = [StreamEvent(raw_id.decode(), fields[b"type"].decode(),
                              fields[b"data"].decode()) for raw_id, fields in entries]
        if events:
            waiter.last = events[-1].event_id
        if len(events) < READ_BATCH:
            waiter.lagging = False
            await self._wake_reader()
        return events

    async def _is_gone(self, request_key: str, stream_key: str) -> bool:
        """No stream, and none to come: the request is unknown, or it ended and its stream
        expired (``queues.resume_window_s``, with the request's record)."""
        if await self.client.exists(stream_key):
            return False
        state = cast(bytes | None, await self.client.hget(request_key, "state"))
        return state is None or RequestState(state.decode()).is_terminal

    async def _wake_reader(self) -> None:
        """Make sure the next XREAD includes the waiter just added."""
        self._changed.set()
        reads_before = self._num_reads
        for _ in range(UNBLOCK_RETRIES):
            if not self._is_blocked or self._reader_id is None or self._num_reads != reads_before:
                return
            if await self.client.client_unblock(self._reader_id):
                return
            # the read was sent but has not reached the server yet: try again in a moment
            await asyncio.sleep(UNBLOCK_RETRY_S)

    async def _tick(self) -> None:
        """Every ``TICK_S``, a tick to each waiter that heard nothing for that long, so it
        checks its stream is still there (and its idle timeout) without a timer per wait."""
        while not self._is_stopping:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for waiters in self._waiters.values():
                for waiter in waiters:
                    if now - waiter.heard_s >= TICK_S and waiter.queue.empty():
                        waiter.heard_s = now
                        waiter.queue.put_nowait(None)

    async def _run(self) -> None:
        is_reconnect = False
        while not self._is_stopping:
            reader = aioredis.Redis(connection_pool=self.client.connection_pool,
                                    single_connection_client=True)
            try:
                self._reader_id = int(await reader.client_id())
                if is_reconnect:
                    await self._recheck(reader)
                is_reconnect = False
                await self._read_forever(reader)
            except (RedisError, OSError) as exc:
                # waiters keep their positions and are served again once Redis is back; each
                # waiter's own existence check fails its request if Redis stays away
                logger.warning("stream reader lost Redis: %s", exc)
                is_reconnect = True
                await asyncio.sleep(RECONNECT_S)
            finally:
                self._reader_id = None
                self._is_blocked = False
                with contextlib.suppress(RedisError, OSError):
                    await reader.aclose()

    async def _recheck(self, reader: aioredis.Redis) -> None:
        """After Redis was away: a waiter whose last event the stream no longer has (a failover
        to a replica that had not received it) reads its stream again from the start; its
        reader skips the tokens its client has (``ReadPoint``). Without this, the events made
        again after the loss could sort before the lost id and never be read."""
        for stream_key, waiters in list(self._waiters.items()):
            for waiter in waiters:
                if waiter.last != START and not await reader.xrange(
                        stream_key, waiter.last, waiter.last, count=1):
                    logger.warning("%s lost events past %s; reading it again from the start",
                                   stream_key, waiter.last)
                    waiter.last = START

    def _read_points(self) -> dict[str, str]:
        """Each stream waited on in the shared read, from its least advanced waiter."""
        streams = {}
        for key, waiters in self._waiters.items():
            if len(waiters) == 1:  # the common case: one client per stream
                if not waiters[0].lagging:
                    streams[key] = waiters[0].last
            elif any(not w.lagging for w in waiters):
                streams[key] = min((w.last for w in waiters if not w.lagging), key=_id_key)
        return streams

    async def _read_forever(self, reader: aioredis.Redis) -> None:
        # NOTE: the reply as Redis sends it (no redis-py parsing into tuples and dicts): this
        # read runs once per engine step with every stream of the router in it
        reader.set_response_callback("XREAD", _raw_reply)
        while not self._is_stopping:
            self._changed.clear()
            streams = self._read_points()
            if not streams:  # nobody waits, or only waiters that catch up by themselves
                await self._changed.wait()
                continue
            self._num_reads += 1
            self._is_blocked = True
            try:
                reply: Any = await reader.execute_command(
                    "XREAD", "COUNT", READ_BATCH, "BLOCK", READ_BLOCK_MS, "STREAMS",
                    *streams, *streams.values())
            finally:
                self._is_blocked = False
            # RESP3 replies with a map of stream to entries, RESP2 with [stream, entries] pairs
            for raw_key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
                key = raw_key.decode()
                self._deliver(key, streams[key], entries)

    def _deliver(self, stream_key: str, start: str, entries: list[Any]) -> None:
        """A read's entries (``[id, [field, value, ...]]``) to the waiters of their stream."""
        start_key: tuple[int, int] | None = None
        for waiter in self._waiters.get(stream_key, []):
            if waiter.lagging:
                continue
            # a waiter read from where it stands takes every entry; one further on skips what
            # it has; one that joined during this read (behind it) would miss what lies
            # between, and waits for the next
            position = None if waiter.last == start else _id_key(waiter.last)
            if position is not None:
                start_key = start_key or _id_key(start)
                if position < start_key:
                    continue
            queue, last = waiter.queue, waiter.last
            for raw_id, fields in entries:
                event_id = raw_id.decode()
                if position is not None and _id_key(event_id) <= position:
                    continue
                if queue.qsize() >= MAX_BUFFERED:
                    waiter.lagging = True  # the rest it reads from the stream (_catch_up)
                    break
                queue.put_nowait(_event(event_id, fields))
                last = event_id
            if last != waiter.last:
                waiter.last, waiter.heard_s = last, time.monotonic()


def _raw_reply(response: Any, **options: Any) -> Any:
    return response


def _event(event_id: str, fields: list[bytes]) -> StreamEvent:
    """A stream entry's event from its flat field list (``type``, ``data``, in any order)."""
    values = dict(zip(fields[::2], fields[1::2], strict=True))
    return StreamEvent(event_id, values[b"type"].decode(), values[b"data"].decode())
