"""Response streams: one Redis STREAM per request joins its dispatcher to its reader.

The writer the lease holder names appends events (``name_writer``, then ``append``: the model
replica running the call, ``router/dispatch/stream_writer.py``; refused once the lease is gone or
another writer is named, so neither a stale dispatcher nor a replica it gave up on can write a
duplicate token); the request's end (complete, cancel while queued,
dead-letter) appends the terminal event in the same script. A reader blocks on the stream and
can resume from the last event id it saw; a finished stream expires after
``queues.resume_window_s``, an idle one after ``keys.STREAM_IDLE_TTL_S``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from router.dispatch.response_events import ChunkData
from router.errors import LeaseLostError, NotFoundError, RouterError, StreamGapError
from router.messages import Lease, LeaseStatus, StreamEvent
from router.state import keys
from router.state.scripts import Script, Scripts

START = "0-0"
MAX_CHOICES_IN_ID = 128  # the positions an event id given back to resume from may carry


@dataclass(slots=True)
class ReadPoint:
    """Where a reader stands in a response stream: the last event it took and each choice's
    output tokens its client has been given.

    Events are read after ``after``; a token chunk at or below its choice's position is one
    the client has already (a Redis failover lost it from the stream and its tokens were made
    again: ``append.lua``) and is skipped. The id a client is given for each event carries
    both (``<stream id>;<p0>,<p1>,...``), so a resume (``Last-Event-ID``) after such a loss
    reads the stream again from its start and still gives each token once.
    """

    after: str = START
    positions: dict[int, int] = field(default_factory=dict)

    def take(self, chunk: ChunkData) -> bool:
        """Whether the chunk is new to the client (then its position is recorded)."""
        if not chunk.position:
            return True
        if chunk.position <= self.positions.get(chunk.index, 0):
            return False
        self.positions[chunk.index] = chunk.position
        return True

    def event_id(self, stream_id: str) -> str:
        """The id the client is given for the event ``stream_id``, taken: the stream id and
        the positions."""
        self.after = stream_id
        if not self.positions:
            return stream_id
        if len(self.positions) == 1 and 0 in self.positions:
            return f"{stream_id};{self.positions[0]}"
        return stream_id + ";" + ",".join(str(self.positions.get(i, 0))
                                          for i in range(max(self.positions) + 1))

    @classmethod
    def parse(cls, event_id: str) -> ReadPoint:
        """A client's event id (its form checked by the caller); positions may be absent."""
        stream_id, _, positions = event_id.partition(";")
        values = positions.split(",") if positions else []
        if len(values) > MAX_CHOICES_IN_ID:
            raise ValueError(f"more than {MAX_CHOICES_IN_ID} positions")
        return cls(stream_id, {i: int(v) for i, v in enumerate(values) if int(v)})

    @property
    def has_positions(self) -> bool:
        return bool(self.positions)


@dataclass(frozen=True, slots=True)
class Event:
    """One event for a response stream; a token chunk names its choice, the position it
    brings that choice to (0: not a token chunk, never dropped) and the one it starts from
    (None: not checked; else the stream must hold exactly that many of the choice's tokens,
    ``append.lua``)."""

    type: str
    data: str
    choice: int = 0
    position: int = 0
    start: int | None = None

    def parts(self) -> list[str]:
        return [self.type, self.data, str(self.choice), str(self.position),
                str(-1 if self.start is None else self.start)]
READ_BLOCK_MS = 1_000
READ_BATCH = 256


class ResponseStreams:
    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.client = scripts.client

    async def append(self, lease: Lease, events: list[Event], writer: str = "") -> LeaseStatus:
        """Append events as ``writer`` (the call the lease holder named, ``name_writer``; ""
        for the holder itself); returns whether a cancel was requested. ``deadline_ms`` of the
        status is 0: appending does not renew the lease. An event with a position at or below
        what its choice has in the stream already is dropped (written once, whoever writes it
        again); one that starts past it raises ``StreamGapError`` (the events before it are
        written)."""
        (result,) = await self.append_many([(lease, writer, events)])
        if isinstance(result, RouterError):
            raise result
        return result

    async def append_many(self, entries: list[tuple[Lease, str, list[Event]]]
                          ) -> list[LeaseStatus | LeaseLostError | StreamGapError]:
        """Appends for several requests in one script call (lease, writer, events); each
        entry's status, or the ``LeaseLostError`` of an entry whose lease is gone or whose
        writer is not the named one, or the ``StreamGapError`` of one whose stream lacks what
        its chunks follow (the others are still written)."""
        args: list[str] = []
        for lease, writer, events in entries:
            args += [keys.check_tenant_id(lease.tenant_id), keys.check_request_id(lease.request_id),
                     lease.holder, str(lease.attempt), writer, str(len(events))]
            args += [part for event in events for part in event.parts()]
        replies = await self.scripts.run(Script.APPEND, len(entries), *args)
        results: list[LeaseStatus | LeaseLostError | StreamGapError] = []
        for (lease, _, _), reply in zip(entries, replies, strict=True):
            if reply[0] == b"stale":
                results.append(LeaseLostError(
                    f"lease on {lease.request_id!r} (attempt {lease.attempt}) lost: "
                    f"the request is {reply[1].decode()}", param="request_id"))
            elif reply[0] == b"gap":
                results.append(StreamGapError(
                    f"the response stream of {lease.request_id!r} lacks chunks its new ones "
                    f"follow (lost in a Redis failover)", param="request_id"))
            else:
                results.append(LeaseStatus(0, bool(int(reply[2]))))
        return results

    async def name_writer(self, lease: Lease, writer: str) -> LeaseStatus:
        """From now on only ``writer`` may append (``append.lua``; "": the holder itself, no
        call). Raises ``LeaseLostError`` when the lease is gone."""
        reply = await self.scripts.run(
            Script.WRITER, keys.check_tenant_id(lease.tenant_id),
            keys.check_request_id(lease.request_id), lease.holder, str(lease.attempt), writer)
        if reply[0] == b"stale":
            raise LeaseLostError(f"lease on {lease.request_id!r} (attempt {lease.attempt}) lost: "
                                 f"the request is {reply[1].decode()}", param="request_id")
        return LeaseStatus(0, bool(int(reply[1])))


    async def read(
        self,
        tenant_id: str,
        request_id: str,
        after: str = START,
        idle_timeout_s: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Events after ``after`` up to and including the terminal one. Raises NotFoundError for
        a request this tenant does not have, TimeoutError after ``idle_timeout_s`` with no event.
        """
        stream_key = keys.stream(tenant_id, request_id)
        request_key = keys.request(tenant_id, request_id)
        if not await self.client.exists(request_key, stream_key):
            raise NotFoundError(f"no request {request_id!r}", param="request_id")
        last, idle_since = after, time.monotonic()
        while True:
            reply: Any = await self.client.xread({stream_key: last}, count=READ_BATCH,
                                            block=READ_BLOCK_MS)
            if not reply:
                if idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                    raise TimeoutError(f"no event on {request_id!r} for {idle_timeout_s} s")
                if not await self.client.exists(request_key, stream_key):
                    raise NotFoundError(f"request {request_id!r} expired", param="request_id")
                continue
            idle_since = time.monotonic()
            for raw_id, fields in reply[0][1]:
                last = raw_id.decode()
                event = StreamEvent(last, fields[b"type"].decode(), fields[b"data"].decode())
                yield event
                if event.is_terminal:
                    return


class AppendBatcher:
    """Coalesces the appends of many requests into few script calls.

    Appends made while a call is in flight wait and go out together in the next one; an append
    with nothing in flight goes out on the next turn of the event loop, so a lone stream gains
    no latency while 32 streams fed by one engine step share one round trip.
    """

    def __init__(self, streams: ResponseStreams) -> None:
        self.streams = streams
        self._pending: list[tuple[Lease, str, list[Event], asyncio.Future[LeaseStatus]]] = []
        self._is_flushing = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def append(self, lease: Lease, events: list[Event], writer: str = "") -> LeaseStatus:
        future: asyncio.Future[LeaseStatus] = asyncio.get_running_loop().create_future()
        self._pending.append((lease, writer, events, future))
        if not self._is_flushing:
            self._is_flushing = True
            asyncio.get_running_loop().call_soon(self._flush_soon)
        return await future

    def _flush_soon(self) -> None:
        task = asyncio.create_task(self._flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await self.streams.append_many(
                        [(lease, writer, events) for lease, writer, events, _ in batch])
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for (*_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, RouterError):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._is_flushing = False
