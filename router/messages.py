"""Typed records exchanged with the tenant queues: what goes in, what a dispatcher is granted."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestState(enum.StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    DEAD = "dead"  # dead-lettered: delivered max_deliveries times without completing

    @property
    def is_terminal(self) -> bool:
        return self in (RequestState.COMPLETED, RequestState.CANCELLED, RequestState.DEAD)


class CancelOutcome(enum.StrEnum):
    CANCELLED = "cancelled"  # was queued: left the queue, reservation refunded
    FLAGGED = "flagged"  # is running: its dispatcher sees the flag and aborts it
    ALREADY_ENDED = "ended"


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    tenant_id: str
    request_id: str
    prompt_tokens: int
    max_tokens: int
    body: str  # the API request as JSON; opaque to the queue
    meta: str = ""  # e.g. the W3C traceparent; opaque to the queue
    expected_output_tokens: int | None = None  # fair-share cost estimate; None: max_tokens
    # choices (OpenAI's n): each may produce max_tokens, so the reservation and the fair-share
    # cost count the output n times (the prompt once: the choices share it)
    num_choices: int = 1
    # the client's reader (router/state/readers.py): an admitted request is attached to it in
    # the same call, counted against the tenant's max_streams; None: nobody reads it yet
    reader: Reader | None = None
    reader_lease_end_ms: int = 0  # when its lease runs out unless renewed (epoch ms)
    # the id comes from an Idempotency-Key: its body's digest outlives the record
    # (keys.IDEMPOTENCY_TTL_S), so a retry after the resume window is told so, never run again
    is_idempotent: bool = False
    # the model the request names (the base or an adapter): refused unless the tenant's
    # allow-list (Tenant.models) has it; "" checks nothing
    model: str = ""
    # the pool (a base model's queues, keys.queue) it waits in; "": the default model's
    pool: str = ""


@dataclass(frozen=True, slots=True)
class Reader:
    """One client reading one request's response stream (``router/state/readers.py``)."""

    tenant_id: str
    request_id: str
    reader_id: str
    kind: ReaderKind

    @property
    def member(self) -> str:
        """Its lease's member of ``fs:{sched}:readers``."""
        return f"{self.tenant_id} {self.request_id} {self.reader_id} {self.kind.value}"


class ReaderKind(enum.StrEnum):
    STREAM = "stream"  # the client that sent the request waits on it, streamed or not
    RESUME = "resume"  # a GET that reads it again (max_resumes)


@dataclass(frozen=True, slots=True)
class Admission:
    request_id: str
    state: RequestState
    is_duplicate: bool  # the id was known: this is the existing request, not a second copy
    queue_depth: int | None  # the tenant's queue length after the push (new requests only)
    # the tenant's rate-limit headers after it (router/state/rate_limits.py; new requests only)
    rate_limit_headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Lease:
    """The right to run one delivery (attempt) of one request, until it expires or is renewed."""

    tenant_id: str
    request_id: str
    holder: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Grant:
    lease: Lease
    lease_deadline_ms: int
    body: str
    meta: str
    prompt_tokens: int
    max_tokens: int
    created_ms: int
    grant_seq: int  # position in the global order of grants
    priority: int = 0
    admit_depth: int = 0  # the tenant's queue length right after this request joined it
    weight: float = 1.0  # the tenant's, when granted: the replica's fair scheduler uses it
    cache_group: str = ""  # the tenant's prefix-cache sharing group ("": its own partition)

    @property
    def tenant_id(self) -> str:
        return self.lease.tenant_id

    @property
    def cache_salt(self) -> str:
        """What roots the request's prefix-cache block hashes: its tenant's own partition, or
        the group it shares with (a tenant id has no ':', so the two never meet)."""
        return f"group:{self.cache_group}" if self.cache_group else self.tenant_id

    @property
    def request_id(self) -> str:
        return self.lease.request_id


@dataclass(frozen=True, slots=True)
class GrantBatch:
    grants: list[Grant]
    warnings: list[str]  # stored data the grant script skipped or read leniently


@dataclass(frozen=True, slots=True)
class LeaseStatus:
    deadline_ms: int
    is_cancel_requested: bool


@dataclass(frozen=True, slots=True)
class ReapResult:
    num_requeued: int
    num_dead: int
    num_dropped: int  # lease entries of requests that had already moved on


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A request as stored (its body left out)."""

    tenant_id: str
    request_id: str
    state: RequestState
    prompt_tokens: int
    max_tokens: int
    reserved_tokens: int
    deliveries: int
    created_ms: int
    is_cancel_requested: bool
    holder: str | None
    lease_deadline_ms: int | None
    prompt_tokens_used: int | None
    output_tokens_used: int | None
    finish_reason: str | None
    end_reason: str | None


@dataclass(frozen=True, slots=True)
class StreamEvent:
    event_id: str  # resume after this id
    type: str  # "chunk", "end" (terminal), "error" (terminal), or a dispatcher's own type
    data: str

    @property
    def is_terminal(self) -> bool:
        return self.type in ("end", "error")


@dataclass(frozen=True, slots=True)
class TenantBacklog:
    tenant_id: str
    priority: int
    num_queued: int
    queued_tokens: int  # fair-share cost of the queued requests: prompt + expected output
    num_leased: int
    pool: str | None = ""  # the model's queues ("": the default model's); None: all pools
