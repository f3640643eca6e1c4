"""What a replica reports back over Ray about a call (``CallReport``), and the usage and
timings of a choice's end. A report crosses as the plain sequence of its one codec
(``CallReport.encode``/``decode``), which Ray packs without pickling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ChunkUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ChunkTimings:
    """Wall-clock instants (``time.time()`` seconds) of a request's life in the engine (the
    engine's ``Timings``: one type on both sides).

    engine queue = first_scheduled - arrived; prefill = first_token - first_scheduled;
    decode = finished - first_token.
    """

    arrived_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    num_prefill_chunks: int = 0
    num_preemptions: int = 0


class Halt:
    """Why a replica stopped a call before its end (``CallReport.halted``)."""

    CANCELLED = "cancelled"  # the request's cancel flag was up (its client went away)
    LEASE_LOST = "lease_lost"  # the stream refused its writes: another holder or writer
    REDIS_UNAVAILABLE = "redis_unavailable"  # no write went through for the outage allowance
    STREAM_GAP = "stream_gap"  # the stream lost chunks this call's follow (a Redis failover)


@dataclass(frozen=True, slots=True)
class CallReport:
    """What a replica tells the dispatcher over Ray about a call; the tokens themselves go to
    the response stream (``CallStream``). The first report of every call names the replica
    (who has the request); while it runs, an empty report now and then says the call is alive
    (all fields empty); each choice's end comes once its last chunk is in the stream, with the
    choice's output tokens there (``position``), its ``usage`` and ``timings``; ``halted`` says
    the replica stopped the call early and why (``Halt``)."""

    replica_id: str | None = None
    index: int = 0
    finish_reason: str | None = None
    position: int = 0
    usage: ChunkUsage | None = None
    timings: ChunkTimings | None = None
    halted: str | None = None

    # NOTE: the codec. Ray packs plain lists, strings and numbers with msgpack and pickles any
    # other object (a slotted dataclass per message cost the replica 0.07 ms each, measured
    # when a message went per token), so a report crosses as the plain sequence of its fields
    # in this order, and nowhere else.
    def encode(self) -> tuple[Any, ...]:
        usage, timings = self.usage, self.timings
        return (self.replica_id, self.index, self.finish_reason, self.position,
                None if usage is None else (usage.prompt_tokens, usage.completion_tokens,
                                            usage.cached_tokens),
                None if timings is None else (
                    timings.arrived_s, timings.first_scheduled_s, timings.first_token_s,
                    timings.finished_s, timings.num_prefill_chunks, timings.num_preemptions),
                self.halted)

    @classmethod
    def decode(cls, wire: Sequence[Any]) -> CallReport:
        replica_id, index, finish, position, usage, timings, halted = wire
        return cls(replica_id, int(index), finish, int(position),
                   None if usage is None else ChunkUsage(*usage),
                   None if timings is None else ChunkTimings(*timings), halted)
