"""A replica's writes into its calls' response streams: one script call per engine step.

The router's code that a replica runs (``replicas.protocol.StreamSink``; ``cluster/app.py``
hands it to the replica deployment): the response streams, their leases and their script are
the router's, so the replica only hands over its chunks and learns whether a call must stop.

Every call a replica runs came with its ``CallStream`` (``replicas/protocol/call.py``); each
chunk the engine makes becomes one chunk event (``router/dispatch/response_events.py``)
carrying the position it brings its choice to. The engine's step hands its chunks to all the
calls' loops in one turn of the event loop, so their appends go out together: one
``append.lua`` call for the whole step (``router.dispatch.streams.AppendBatcher``), fenced by
each call's lease and writer, deduplicated by position. A Redis restart is ridden out for
``REDIS_OUTAGE_S`` (the engine goes on meanwhile and the chunks wait in the calls' queues);
after that the call is halted and its dispatcher decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from replicas.protocol import CallStream, Halt, LogprobWire
from router.dispatch import response_events
from router.dispatch.streams import AppendBatcher, Event, ResponseStreams
from router.errors import LeaseLostError, StreamGapError
from router.messages import Lease, LeaseStatus
from router.state.redis_client import connect, with_env_password
from router.state.scripts import Scripts

logger = logging.getLogger(__name__)

REDIS_OUTAGE_S = 30.0  # as the dispatcher's own writes (router/dispatch/relay.py)
REDIS_RETRY_S = 0.5
POOL_SIZE = 8  # one script call in flight per step; a few for outages and shutdown


class StreamWriter:
    """``replicas.protocol.StreamSink`` on the response streams in Redis at ``redis_url`` (the
    password, if any, from this process's environment)."""

    def __init__(self, redis_url: str) -> None:
        self.client = connect(with_env_password(redis_url), max_connections=POOL_SIZE,
                              socket_timeout=10)
        self.appends = AppendBatcher(ResponseStreams(Scripts(self.client)))

    async def write(self, stream: CallStream, text: str, token_ids: Sequence[int],
                    position: int, logprobs: list[LogprobWire] | None, index: int,
                    finish_reason: str | None) -> str | None:
        """Append one chunk event; why the call must stop (``Halt``): its lease or writer is
        gone, its stream lost the chunks before this one (a Redis failover), Redis has been
        away for ``REDIS_OUTAGE_S``, or its client cancelled it; None: go on."""
        try:
            status = await self.append(stream, text, token_ids, position, logprobs, index,
                                       finish_reason)
        except LeaseLostError as exc:
            logger.warning("%s: stopped: %s", stream.request_id, exc.message)
            return Halt.LEASE_LOST
        except StreamGapError as exc:
            logger.warning("%s: stopped: %s", stream.request_id, exc.message)
            return Halt.STREAM_GAP
        except (RedisError, OSError) as exc:
            logger.error("%s: stopped, Redis unreachable: %s", stream.request_id, exc)
            return Halt.REDIS_UNAVAILABLE
        return Halt.CANCELLED if status.is_cancel_requested else None

    async def append(self, stream: CallStream, text: str, token_ids: Sequence[int],
                     position: int, logprobs: list[LogprobWire] | None, index: int,
                     finish_reason: str | None) -> LeaseStatus:
        """Append one chunk event; raises ``LeaseLostError`` when the call may no longer
        write, ``StreamGapError`` when the stream lost the chunks before it (a Redis
        failover), a ``RedisError`` once Redis has been away for ``REDIS_OUTAGE_S``."""
        data = response_events.chunk_data(text, list(token_ids), position, logprobs, index,
                                          finish_reason)
        # a chunk with tokens follows the choice's tokens in the stream, or is refused (a gap)
        start = position - len(token_ids) if position else None
        event = Event(response_events.CHUNK, data, index, position, start)
        lease = Lease(stream.tenant_id, stream.request_id, stream.holder, stream.attempt)
        deadline = time.monotonic() + REDIS_OUTAGE_S
        while True:
            try:
                return await self.appends.append(lease, [event], stream.writer)
            except (RedisError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise
                logger.warning("Redis unreachable (%s); retrying", exc)
                await asyncio.sleep(REDIS_RETRY_S)

    async def close(self) -> None:
        await self.client.aclose()
