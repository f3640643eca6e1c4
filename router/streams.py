"""Response streams: one Redis STREAM per request joins its dispatcher to its reader.

The lease holder appends events (``append``, refused once its lease is gone, so a stale
dispatcher cannot write a duplicate token); the request's end (complete, cancel while queued,
dead-letter) appends the terminal event in the same script. A reader blocks on the stream and
can resume from the last event id it saw; a finished stream expires after
``keys.STREAM_ENDED_TTL_S``, an idle one after ``keys.STREAM_IDLE_TTL_S``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from router import keys
from router.errors import LeaseLostError, NotFoundError
from router.messages import Lease, LeaseStatus, StreamEvent
from router.scripts import Script, Scripts

START = "0-0"
READ_BLOCK_MS = 1_000
READ_BATCH = 256


class ResponseStreams:
    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.client = scripts.client

    async def append(self, lease: Lease, events: list[tuple[str, str]]) -> LeaseStatus:
        """Append (type, data) events; returns whether a cancel was requested. ``deadline_ms`` of
        the status is 0: appending does not renew the lease."""
        flat = [part for event in events for part in event]
        reply = await self.scripts.run(
            Script.APPEND, keys.check_tenant_id(lease.tenant_id),
            keys.check_request_id(lease.request_id), lease.holder, str(lease.attempt), *flat)
        if reply[0] == b"stale":
            raise LeaseLostError(
                f"lease on {lease.request_id!r} (attempt {lease.attempt}) lost: "
                f"the request is {reply[1].decode()}", param="request_id")
        return LeaseStatus(0, bool(int(reply[2])))

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
