"""The tenant gate: the outermost layer of a router's API, so no tenant can take its slots.

A router holds at most ``router.max_ongoing_requests`` HTTP requests at once (Ray Serve's
limit); past it, requests wait in Ray Serve's proxy and go the slow way (an actor call per
message). The tenants' own caps (``max_streams``, ``max_resumes``, quotas) are counted in Redis
and answered by the handler: a tenant that keeps thousands of connections open, or sends a new
request the moment one is refused, would still hold the router's slots while each waits for its
answer, and another tenant's request would wait behind them.

So each router counts the requests inside it per tenant and answers one over
``router.api.max_requests_per_tenant`` with a 429 at once: before its body is read or parsed,
from memory, with no Redis round trip. The tenant of a request is known by its key: the router
remembers the digest of each key that authenticated on it (``KnownKeys.learn``, from the
handler's authentication) for ``KNOWN_KEY_TTL_S``; a key it does not know goes through to be
authenticated (the first requests of a key are counted from then on). The gate only ever
refuses, never lets through what the handler would refuse, so a key revoked a moment ago can at
most be refused here a little longer.

It also remembers a quota refusal: when the check before admission finds a tenant's rpm, tpm or
daily budget used up (no request of it could be admitted for ``Retry-After``), the gate answers
the tenant's next submissions with the same 429 until then (``REFUSAL_MEMORY_S`` at most, so a
raised limit is heard soon), without reading them. A submission with an ``Idempotency-Key`` goes
through (a retry joins a request admitted before, and is never
refused for its quota), as do resumes and reads.

And it paces a tenant's 429s, its own and the handler's (quotas, queue, open streams): each gets
a Retry-After ``1 / REFUSALS_PER_S`` after the tenant's previous one (never less than the limit
said, never more than ``MAX_RETRY_AFTER_S``). A tenant with 2,000 clients at its limits that
honour Retry-After (the openai SDKs do) thus comes back 50 a second, not 2,000: a router spends
its CPU on the other tenants' requests, not on refusing the same one. (A client that ignores
Retry-After and sends again at once is an HTTP flood, which the edge in front of the routers
must limit, by key or by address.)
"""

from __future__ import annotations

import collections
import json
import math
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import RateLimitError
from router.state.api_keys import digest

REFUSALS_PER_S = 50  # a tenant's 429s one router spaces its Retry-Afters to (see TenantGate)
MAX_RETRY_AFTER_S = 60  # the openai SDK waits out a Retry-After up to 60 s
REFUSAL_MEMORY_S = 5.0  # a quota refusal is answered from memory this long at most (an
# operator who raises the tenant's limits is heard within it, even for a day's budget)
KNOWN_KEY_TTL_S = 60.0
MAX_KNOWN_KEYS = 100_000  # digests remembered (~200 bytes each); the oldest are forgotten first
RETRY_AFTER_S = 1
REASON = "router_requests"


class KnownKeys:
    """The tenants of the keys that authenticated on this router lately, by the key's digest;
    and the tenants a quota refuses for a while."""

    def __init__(self) -> None:
        self._tenants: collections.OrderedDict[str, tuple[str, float]] = (
            collections.OrderedDict())  # key digest -> (tenant, when learned, monotonic s)
        # tenant -> (until, why, when: monotonic s)
        self._refusals: dict[str, tuple[float, RateLimitError, float]] = {}

    def refused(self, tenant_id: str, refusal: RateLimitError) -> None:
        """No request of ``tenant_id`` can be admitted before ``refusal.retry_after_s`` (its
        rpm, tpm or daily budget is used up: the quota check before admission says)."""
        now = time.monotonic()
        self._refusals[tenant_id] = (now + min(refusal.retry_after_s, REFUSAL_MEMORY_S),
                                     refusal, now)
        if len(self._refusals) > MAX_KNOWN_KEYS:
            now = time.monotonic()
            self._refusals = {t: r for t, r in self._refusals.items() if r[0] > now}

    def refusal(self, tenant_id: str) -> tuple[float, RateLimitError, float] | None:
        """The quota refusal of ``tenant_id`` still running: seconds left, the refusal, and
        seconds since it was made."""
        found = self._refusals.get(tenant_id)
        if found is None:
            return None
        left = found[0] - time.monotonic()
        if left <= 0:
            del self._refusals[tenant_id]
            return None
        return left, found[1], time.monotonic() - found[2]

    def learn(self, key_digest: str, tenant_id: str) -> None:
        """The key of digest ``key_digest`` (``api_keys.digest``) proved to be ``tenant_id``'s
        (the handler's authentication says)."""
        self._tenants[key_digest] = (tenant_id, time.monotonic())
        self._tenants.move_to_end(key_digest)
        while len(self._tenants) > MAX_KNOWN_KEYS:
            self._tenants.popitem(last=False)

    def tenant_of(self, authorization: bytes) -> str | None:
        """The tenant of an ``Authorization`` header's key, if it authenticated here lately."""
        scheme, _, credential = authorization.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return None
        known = self._tenants.get(digest(credential.strip()))
        if known is None or time.monotonic() - known[1] > KNOWN_KEY_TTL_S:
            return None
        return known[0]


class TenantGate:
    def __init__(self, app: ASGIApp, known: KnownKeys, max_requests_per_tenant: int) -> None:
        self.app = app
        self.known = known
        self.limit = max_requests_per_tenant
        self.inside: collections.Counter[str] = collections.Counter()  # tenant -> requests
        self._next_retry: dict[str, float] = {}  # tenant -> the last Retry-After given (mono s)

    def paced(self, tenant: str, at_least_s: float) -> int:
        """The Retry-After (whole seconds) of a 429 to ``tenant``: at least ``at_least_s``, and
        after the tenant's previous 429s by ``1 / REFUSALS_PER_S`` each, so clients that honour
        it come back at most ``REFUSALS_PER_S`` a second whatever their number."""
        now = time.monotonic()
        slot = max(now + at_least_s, self._next_retry.get(tenant, now) + 1 / REFUSALS_PER_S)
        slot = min(slot, now + MAX_RETRY_AFTER_S)
        self._next_retry[tenant] = slot
        if len(self._next_retry) > MAX_KNOWN_KEYS:
            self._next_retry = {t: at for t, at in self._next_retry.items() if at > now}
        return max(1, math.ceil(slot - now))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant, is_retry = None, False
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"authorization":
                    tenant = self.known.tenant_of(value)
                elif name == b"idempotency-key":
                    is_retry = True
        if tenant is None:
            await self.app(scope, receive, send)
            return
        if self.inside[tenant] >= self.limit:
            await _refuse(send, REASON, f"the tenant has {self.limit} requests in this router "
                          "already (router.api.max_requests_per_tenant)",
                          self.paced(tenant, RETRY_AFTER_S))
            return
        refusal = None if is_retry or scope["method"] != "POST" else self.known.refusal(tenant)
        if refusal is not None:  # a retry may join a request admitted before: let it through
            left_s, error, since_s = refusal  # its limits' resets moved on by the time since
            await _refuse(send, error.reason, str(error).split(";")[0],
                          self.paced(tenant, left_s), error.headers(since_s))
            return

        async def paced_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                headers = [(k, v) for k, v in message["headers"] if k != b"retry-after"]
                given = [float(v) for k, v in message["headers"] if k == b"retry-after"]
                retry_after = self.paced(tenant, given[0] if given else RETRY_AFTER_S)
                message = {**message, "headers": [
                    *headers, (b"retry-after", str(retry_after).encode())]}
            await send(message)

        self.inside[tenant] += 1
        try:
            await self.app(scope, receive, paced_send)
        finally:
            self.inside[tenant] -= 1
            if not self.inside[tenant]:
                del self.inside[tenant]


async def _refuse(send: Send, code: str, message: str, retry_after: int,
                  extra: dict[str, str] | None = None) -> None:
    """A 429 in OpenAI's shape, with Retry-After (whole seconds) and ``extra`` headers."""
    body = json.dumps({"error": {
        "message": f"{message}; retry after {retry_after} s", "type": "rate_limit_error",
        "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after).encode()), (b"x-ratelimit-reason", code.encode()),
        *((k.encode(), v.encode()) for k, v in (extra or {}).items())]})
    await send({"type": "http.response.body", "body": body})
