"""Durable per-tenant queues in Redis: admission, grants with leases, settlement, requeue.

Every transition is one Lua script (``router/state/scripts/*.lua``), so any number of routers and
dispatchers can share one Redis: a request is admitted once per id, granted to one holder at a
time, and ends exactly once (completed, cancelled or dead-lettered). A holder that stops
renewing loses its lease to the reaper, and every later call it makes with that lease is
refused (``LeaseLostError``) because the attempt number moved on.

NOTE: fair share. Priority classes are strict: the grant script always serves the highest class
with backlog. Inside a class it runs start-time fair queuing (SFQ; Goyal et al. 1996) over
tenants, with a request's cost = prompt tokens + expected output tokens (``max_tokens`` unless
the router knows better):

- each tenant keeps a finish tag F; the class keeps a virtual time V (the start tag of the last
  grant);
- a tenant that gets backlogged starts at S = max(V, F), so idle time banks no credit;
- the backlogged tenant with the smallest S is served; then F = S + cost / weight and, if more
  is queued, its next S = F.

Why SFQ and not deficit round robin: a grant is one O(log n) ZSET read (the smallest start tag)
with no rounds to walk and no quantum to tune, and costs vary by 1000x (a 10-token chat turn
beside a 30,000-token document): DRR needs a quantum of at least the largest cost to stay O(1)
per grant, and with it a small tenant waits a whole large quantum of each other tenant. SFQ
bounds each continuously backlogged tenant's service to within one largest request of its
weighted share at every moment, and a tenant waits at most one request of every other tenant
per unit of its own virtual time: no starvation.

Costs are settled: at completion F (and S, if backlogged) moves by (actual - expected) / weight,
so fairness ends up measured in the tokens really used. A requeued request gets its charge back
(F -= cost / weight) and goes to the head of its tenant's queue: the failed attempt costs the
tenant nothing. A request cancelled while queued was never charged; one cancelled while running
is settled like a completion, by the tokens it used; a dead-lettered request keeps its last
charge.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from typing import Any, NoReturn, cast

from router.config import QueueSettings
from router.errors import (
    MAX_TOKENS_OVER_TENANT_CAP,
    IdempotencyKeyExpiredError,
    IdempotencyKeyReusedError,
    InvalidRequestError,
    LeaseLostError,
    NotFoundError,
    NotReplicatedError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    RouterError,
    StoredDataError,
    StreamGapError,
)
from router.messages import (
    Admission,
    AdmitRequest,
    CancelOutcome,
    Grant,
    GrantBatch,
    Lease,
    LeaseStatus,
    Reader,
    ReapResult,
    RequestRecord,
    RequestState,
    TenantBacklog,
)
from router.state import keys
from router.state.adapters import model_not_found
from router.state.rate_limits import RateLimits
from router.state.scripts import Script, Scripts

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
COMPLETE_BATCH = 128  # completions per script call: long enough to amortise, short for latency

_REFUSAL_MESSAGES = {
    "disabled": "tenant is disabled",
    "queue_full": "the tenant's queue is full",
    "rpm": "requests-per-minute limit reached",
    "tpm": "tokens-per-minute limit reached",
    "daily_budget": "daily token budget used up",
    "streams": "the tenant has its limit of open requests (max_streams) being waited on",
    "resumes": "the tenant has its limit of resumed streams (max_resumes) open",
    "readers": f"the request has {keys.MAX_READERS_PER_REQUEST} clients reading it already",
}
RENEW_READERS_BATCH = 1_000


class TenantQueues:
    def __init__(self, scripts: Scripts, settings: QueueSettings | None = None) -> None:
        self.scripts = scripts
        self.client = scripts.client
        self.settings = settings or QueueSettings()

    # ---- admission ----

    async def admit(self, request: AdmitRequest) -> Admission:
        if not self.settings.replicas_to_ack:
            reply = await self.scripts.run(Script.ADMIT, *self._admit_args(request))
            return _admission(request, reply)
        result = (await self.admit_many([request]))[0]
        if isinstance(result, RouterError):
            raise result
        return result

    async def admit_many(self, requests: list[AdmitRequest]) -> list[Admission | RouterError]:
        """Pipelined admissions; each entry is the admission or the error that refused it.
        With ``replicas_to_ack``, the pipeline ends with a ``WAIT``: an admission that fewer
        replicas acknowledged within ``ack_timeout_ms`` is a NotReplicatedError (503) instead,
        since a failover could lose it."""
        wanted = self.settings.replicas_to_ack
        replies, acked = await self.scripts.run_many_acked(
            Script.ADMIT, [self._admit_args(r) for r in requests], wanted,
            self.settings.ack_timeout_ms)
        results: list[Admission | RouterError] = []
        for request, reply in zip(requests, replies, strict=True):
            try:
                admission = _admission(request, reply)
            except RouterError as exc:
                results.append(exc)
                continue
            if acked < wanted:
                results.append(NotReplicatedError(acked, wanted, self.settings.ack_timeout_ms))
            else:
                results.append(admission)
        return results

    def _admit_args(self, request: AdmitRequest) -> tuple[Any, ...]:
        keys.check_tenant_id(request.tenant_id)
        keys.check_request_id(request.request_id)
        expected = request.max_tokens if request.expected_output_tokens is None else (
            request.expected_output_tokens)
        for name, value, low in (("prompt_tokens", request.prompt_tokens, 0),
                                 ("max_tokens", request.max_tokens, 1),
                                 ("expected_output_tokens", expected, 0),
                                 ("num_choices", request.num_choices, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}",
                                          param=name)
        if len(request.body.encode()) > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"request body over {MAX_BODY_BYTES} bytes", param="body")
        reader = request.reader
        return (request.tenant_id, request.request_id, request.prompt_tokens, request.max_tokens,
                expected, request.body, request.meta, self.settings.queue_full_retry_after_ms,
                request.num_choices, reader.reader_id if reader else "",
                request.reader_lease_end_ms, "1" if request.is_idempotent else "",
                request.model, keys.check_pool(request.pool))

    # ---- grants and leases ----

    async def grant(self, holder: str, free_slots: int, max_grants: int | None = None,
                    capacity: int | None = None, pool: str = "") -> GrantBatch:
        """Up to ``min(free_slots, max_grants)`` requests of ``pool`` (a model's queues; "":
        the default model's), each leased to ``holder``; with ``capacity`` (the slots of the
        pool's replicas) also no more than ``capacity`` minus the pool's leases live in the
        whole cluster, counted atomically with the grant."""
        if free_slots <= 0:
            return GrantBatch([], [])
        limit = max_grants or self.settings.max_grants_per_call
        reply = await self.scripts.run(Script.GRANT, holder, self.settings.lease_ms, free_slots,
                                       limit, "" if capacity is None else capacity,
                                       keys.check_pool(pool))
        grants = [_grant(holder, g) for g in reply[0]]
        warnings = [w.decode() for w in reply[1]]
        if warnings:
            logger.warning("grant skipped or read leniently malformed data: %s", warnings)
        return GrantBatch(grants, warnings)

    async def renew(self, lease: Lease) -> LeaseStatus:
        reply = await self.scripts.run(Script.RENEW, *_lease_args(lease), self.settings.lease_ms)
        _check_lease(lease, reply)
        return LeaseStatus(int(reply[1]), bool(int(reply[2])))

    async def complete(
        self,
        lease: Lease,
        prompt_tokens_used: int,
        output_tokens_used: int,
        finish_reason: str,
        final_event: str = "{}",
        outcome: RequestState = RequestState.COMPLETED,
        must_hold: int | None = None,
    ) -> int:
        """Acknowledge and settle; returns the tokens refunded (negative: charged beyond the
        reservation). ``final_event`` is the data of the stream's terminal ``end`` event.
        ``must_hold``: the output tokens the response stream must hold, else nothing changes and
        ``StreamGapError`` is raised (a Redis failover lost its last chunks)."""
        args = self._complete_args(lease, prompt_tokens_used, output_tokens_used, finish_reason,
                                   final_event, outcome, must_hold)
        (reply,) = await self.scripts.run(Script.COMPLETE, 1, *args)
        _check_lease(lease, reply)
        if reply[0] == b"gap":
            raise StreamGapError(f"the response stream of {lease.request_id!r} holds "
                                 f"{int(reply[1])} of its {must_hold} output tokens (a Redis "
                                 f"failover lost the rest)", param="request_id")
        return int(reply[1])

    async def complete_many(self, calls: list[tuple[Lease, int, int, str]],
                            final_event: str = "{}") -> list[int | None]:
        """Completions of (lease, prompt used, output used, finish reason), one script call per
        ``COMPLETE_BATCH``, each with ``final_event`` as its stream's terminal event; the
        refund of each, or None where the lease was lost."""
        refunds: list[int | None] = []
        for start in range(0, len(calls), COMPLETE_BATCH):
            chunk = calls[start:start + COMPLETE_BATCH]
            args = [a for c in chunk
                    for a in self._complete_args(*c, final_event, RequestState.COMPLETED)]
            replies = await self.scripts.run(Script.COMPLETE, len(chunk), *args)
            refunds += [int(r[1]) if r[0] == b"ok" else None for r in replies]
        return refunds

    @staticmethod
    def _complete_args(lease: Lease, prompt_used: int, output_used: int, finish_reason: str,
                       final_event: str, outcome: RequestState, must_hold: int | None = None
                       ) -> tuple[Any, ...]:
        if outcome not in (RequestState.COMPLETED, RequestState.CANCELLED):
            raise ValueError(f"a holder completes as completed or cancelled, not {outcome}")
        return (*_lease_args(lease), outcome.value, int(prompt_used), int(output_used),
                finish_reason, final_event, -1 if must_hold is None else int(must_hold))

    async def requeue(self, lease: Lease, reason: str, is_holder_stopping: bool = False
                      ) -> RequestState:
        """Give the request back: head of its tenant's queue, or dead past max_deliveries.
        ``is_holder_stopping``: the holder gives it back because it is shutting down (a
        rolling restart), not because the request failed: that delivery does not count."""
        reply = await self.scripts.run(Script.REQUEUE, *_lease_args(lease),
                                       self.settings.max_deliveries, reason,
                                       "1" if is_holder_stopping else "0")
        _check_lease(lease, reply)
        return RequestState(reply[0].decode())

    async def reap(self) -> ReapResult:
        reply = await self.scripts.run(Script.REAP, self.settings.max_deliveries,
                                       self.settings.reap_batch)
        return ReapResult(*(int(n) for n in reply))

    # ---- readers: detached requests are cancelled after a grace period ----

    async def attach(self, reader: Reader, lease_end_ms: int) -> None:
        """A client reads the request's stream: it is not detached (any more); refused (429)
        when its tenant has its limit of readers of this kind open."""
        reply = await self.scripts.run(
            Script.READERS, "attach", keys.check_tenant_id(reader.tenant_id),
            keys.check_request_id(reader.request_id), reader.reader_id, reader.kind.value,
            lease_end_ms)
        if reply[0] == b"missing":
            raise NotFoundError(f"no request {reader.request_id!r}", param="request_id")
        if reply[0] == b"refused":
            _refuse(reply[1].decode(), int(reply[2]))

    async def detach(self, reader: Reader, deadline_ms: int) -> int:
        """A client went away (or its stream ended); a request nobody reads any more is
        cancelled at ``deadline_ms`` unless a reader comes back (``attach``). Returns the
        request's readers now, -1 if this reader had been let go already."""
        reply = await self.scripts.run(
            Script.READERS, "detach", keys.check_tenant_id(reader.tenant_id),
            keys.check_request_id(reader.request_id), reader.reader_id, reader.kind.value,
            deadline_ms)
        return int(reply[1])

    async def renew_readers(self, members: list[str], lease_end_ms: int) -> None:
        """Extend the leases of readers still connected (``Reader.member``); one that was let
        go meanwhile stays gone (ZADD XX)."""
        for start in range(0, len(members), RENEW_READERS_BATCH):
            batch = members[start:start + RENEW_READERS_BATCH]
            await self.client.zadd(keys.readers(), dict.fromkeys(batch, lease_end_ms), xx=True)

    async def sweep_readers(self, grace_ms: int, limit: int = 100) -> int:
        """Let go of the readers whose lease ran out (their router stopped renewing them):
        counted down as a detach would; returns how many."""
        reply = await self.scripts.run(Script.READERS, "sweep", limit, grace_ms)
        return int(reply[1])

    async def reap_detached(self, limit: int = 100) -> int:
        """Cancel the detached requests whose grace has run out; returns how many."""
        now_ms = int(time.time() * 1000)
        members = cast(list[bytes], await self.client.zrangebyscore(
            keys.detached(), "-inf", now_ms, start=0, num=limit))
        num_cancelled = 0
        for member in members:
            if not await self.client.zrem(keys.detached(), member):
                continue  # a reader came back, or another dispatcher took it
            tenant_id, _, request_id = member.decode().partition(" ")
            with contextlib.suppress(NotFoundError):
                await self.cancel(tenant_id, request_id, "detached")
                num_cancelled += 1
        return num_cancelled

    # ---- cancellation and inspection ----

    async def cancel(self, tenant_id: str, request_id: str, reason: str = "client") -> CancelOutcome:
        reply = await self.scripts.run(Script.CANCEL, keys.check_tenant_id(tenant_id),
                                       keys.check_request_id(request_id), reason)
        if reply[0] == b"missing":
            raise NotFoundError(f"no request {request_id!r}", param="request_id")
        return CancelOutcome(reply[0].decode())

    async def get(self, tenant_id: str, request_id: str) -> RequestRecord:
        fields = cast(dict[bytes, bytes],
                      await self.client.hgetall(keys.request(tenant_id, request_id)))
        if not fields:
            raise NotFoundError(f"no request {request_id!r}", param="request_id")
        return _record(tenant_id, request_id, fields)

    async def queued_ids(self, tenant_id: str, pool: str = "") -> list[str]:
        ids = cast(list[bytes], await self.client.lrange(keys.queue(tenant_id, pool), 0, -1))
        return [m.decode() for m in ids]

    async def depth(self, tenant_id: str, pool: str = "") -> int:
        return int(await self.client.llen(keys.queue(tenant_id, pool)))

    async def num_leased(self, pool: str = "") -> int:
        return int(await self.client.zcard(keys.leases(pool)))

    async def backlog(self, by_pool: bool = False) -> list[TenantBacklog]:
        """Per tenant: queued requests and their token cost, and leased (running) requests,
        over all pools (``pool`` None); ``by_pool``: per tenant and pool instead (the default
        pool's row for every tenant, another's where the tenant has something in it)."""
        rows = [TenantBacklog(r[0].decode(), int(r[2]), int(r[3]), int(r[4]), int(r[5]),
                              r[1].decode()) for r in await self.scripts.run(Script.BACKLOG)]
        if by_pool:
            return rows
        total: dict[str, TenantBacklog] = {}
        for row in rows:
            seen = total.get(row.tenant_id)
            total[row.tenant_id] = replace(row, pool=None) if seen is None else replace(
                seen, num_queued=seen.num_queued + row.num_queued,
                queued_tokens=seen.queued_tokens + row.queued_tokens,
                num_leased=seen.num_leased + row.num_leased)
        return list(total.values())


def _lease_args(lease: Lease) -> tuple[str, str, str, str]:
    return (keys.check_tenant_id(lease.tenant_id), keys.check_request_id(lease.request_id),
            lease.holder, str(lease.attempt))


def _check_lease(lease: Lease, reply: list[Any]) -> None:
    if reply[0] == b"stale":
        raise LeaseLostError(
            f"lease on {lease.request_id!r} (attempt {lease.attempt}) is no longer held by "
            f"{lease.holder!r}: the request is {reply[1].decode()}",
            param="request_id",
        )


def _admission(request: AdmitRequest, reply: list[Any]) -> Admission:
    verdict = reply[0].decode()
    if verdict == "admitted":
        headers = RateLimits.from_reply(reply[2]).headers() if len(reply) > 2 else {}
        return Admission(request.request_id, RequestState.QUEUED, False, int(reply[1]), headers)
    if verdict == "duplicate":
        return Admission(request.request_id, RequestState(reply[1].decode()), True, None)
    if verdict == "expired":
        raise IdempotencyKeyExpiredError(
            f"the request with this Idempotency-Key ({request.request_id!r}) ended more than "
            "the resume window ago: its result is no longer kept, and it is not run again; "
            "send it with a new key to run it again", param="Idempotency-Key")
    if verdict == "conflict":
        raise IdempotencyKeyReusedError(
            f"request id {request.request_id!r} (an Idempotency-Key) was already used for a "
            "different request", param="Idempotency-Key",
        )
    if verdict == "model":
        raise model_not_found(request.model)
    reason = reply[1].decode()
    if verdict == "too_large":
        limit = int(reply[2])
        if reason == "max_tokens":
            raise InvalidRequestError(
                f"max_tokens {request.max_tokens} exceeds this tenant's cap of {limit}",
                param="max_tokens", code=MAX_TOKENS_OVER_TENANT_CAP,
            )
        raise RequestTooLargeError(
            f"prompt + max_tokens = {request.prompt_tokens + request.max_tokens} tokens exceeds "
            f"the tenant's {reason} limit of {limit}",
            param="max_tokens",
        )
    if reason == "disabled":
        raise PermissionDeniedError("tenant is disabled", param="tenant")
    limits = RateLimits.from_reply(reply[3]) if len(reply) > 3 else None
    _refuse(reason, int(reply[2]), limits)


def _refuse(reason: str, retry_after_ms: int, limits: RateLimits | None = None) -> NoReturn:
    raise refusal(reason, retry_after_ms, limits)


def refusal(reason: str, retry_after_ms: int, limits: RateLimits | None = None
            ) -> RateLimitError:
    """The 429 of a refusal ``reason`` (admit.lua's, readers.lua's, or the quota check's),
    with the tenant's limiters for its rate-limit headers."""
    retry_after_s = retry_after_ms / 1000
    return RateLimitError(f"{_REFUSAL_MESSAGES[reason]}; retry after {retry_after_s:.3f} s",
                          reason, retry_after_s, limits)


def _grant(holder: str, g: list[Any]) -> Grant:
    tenant_id, request_id = g[0].decode(), g[1].decode()
    return Grant(
        lease=Lease(tenant_id, request_id, holder, int(g[2])),
        lease_deadline_ms=int(g[3]),
        body=(g[4] or b"").decode(),
        meta=(g[5] or b"").decode(),
        prompt_tokens=int(g[6]),
        max_tokens=int(g[7]),
        created_ms=int(g[8]),
        grant_seq=int(g[9]),
        priority=int(g[10]),
        admit_depth=int(g[11]),
        weight=float(g[12]),
        cache_group=(g[13] or b"").decode() if len(g) > 13 else "",
    )


def _record(tenant_id: str, request_id: str, raw: dict[bytes, bytes]) -> RequestRecord:
    f = {k.decode(): v.decode() for k, v in raw.items()}

    def opt_int(name: str) -> int | None:
        return int(f[name]) if f.get(name) else None

    try:
        return RequestRecord(
            tenant_id=tenant_id,
            request_id=request_id,
            state=RequestState(f["state"]),
            prompt_tokens=int(f["prompt_tokens"]),
            max_tokens=int(f["max_tokens"]),
            reserved_tokens=int(f["reserved"]),
            deliveries=int(f["deliveries"]),
            created_ms=int(f["created_ms"]),
            is_cancel_requested=f.get("cancel") == "1",
            holder=f.get("holder") or None,
            lease_deadline_ms=opt_int("lease_deadline"),
            prompt_tokens_used=opt_int("prompt_tokens_used"),
            output_tokens_used=opt_int("output_tokens_used"),
            finish_reason=f.get("finish_reason") or None,
            end_reason=f.get("end_reason") or None,
        )
    except (KeyError, ValueError) as exc:
        raise StoredDataError(
            f"malformed request record {keys.request(tenant_id, request_id)}: {exc}"
        ) from None
