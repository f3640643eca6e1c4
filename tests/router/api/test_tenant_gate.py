"""The tenant gate (router/api/tenant_gate.py), the outermost layer of a router's API: a tenant
holds at most ``max_requests_per_tenant`` of a router's requests (429 at once beyond, before the
body is read), a quota refusal is answered from memory until it runs out (an Idempotency-Key
retry and reads go through), and a tenant's 429s are paced by Retry-After so clients that
honour it come back ``REFUSALS_PER_S`` a second, whatever their number.

The gate runs in front of a small ASGI app of the test's (it holds requests open or answers 429
as told), driven through httpx's ASGI transport; keys are learned from the real ``ApiKeys``
authentication on a real Redis."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from router.api.tenant_gate import (
    MAX_RETRY_AFTER_S,
    REASON,
    REFUSAL_MEMORY_S,
    REFUSALS_PER_S,
    KnownKeys,
    TenantGate,
)
from router.errors import RateLimitError
from router.state.api_keys import ApiKeys, digest
from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, make_request, run


class Inner:
    """The app behind the gate: ``/hold`` waits until released, ``/refuse`` answers 429 with
    Retry-After 1; each request seen is counted."""

    def __init__(self) -> None:
        self.seen = 0
        self.release = asyncio.Event()
        self.holding = 0

    def app(self) -> Starlette:
        async def hold(request: Request) -> JSONResponse:
            self.seen += 1
            self.holding += 1
            await self.release.wait()
            self.holding -= 1
            return JSONResponse({"ok": True})

        async def refuse(request: Request) -> JSONResponse:
            self.seen += 1
            return JSONResponse({"error": {"code": "tpm"}}, status_code=429,
                                headers={"Retry-After": "1"})

        return Starlette(routes=[Route("/hold", hold, methods=["GET", "POST"]),
                                 Route("/refuse", refuse, methods=["POST"])])


def gate(limit: int = 1000) -> tuple[TenantGate, KnownKeys, Inner]:
    known, inner = KnownKeys(), Inner()
    return TenantGate(inner.app(), known, limit), known, inner


def client(app: TenantGate) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gate")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_holds_at_most_its_share_of_a_routers_requests() -> None:
    async def scenario() -> None:
        app, known, inner = gate(limit=2)
        known.learn(digest("key-a"), "a")
        known.learn(digest("key-b"), "b")
        async with client(app) as http:
            held = [asyncio.create_task(http.post("/hold", headers=auth("key-a")))
                    for _ in range(2)]
            while inner.holding < 2:
                await asyncio.sleep(0.01)
            refused = await http.post("/hold", headers=auth("key-a"), content=b"x" * 1000)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == REASON
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.headers["x-ratelimit-reason"] == REASON
            assert inner.seen == 2  # refused before the app saw it
            # another tenant, and a key the gate does not know, go through
            others = [asyncio.create_task(http.post("/hold", headers=auth(k)))
                      for k in ("key-b", "unknown")]
            while inner.holding < 4:
                await asyncio.sleep(0.01)
            inner.release.set()
            assert [r.status_code for r in await asyncio.gather(*held, *others)] == [200] * 4
            assert app.inside == {}  # each request's end gave its place back
            assert (await http.post("/hold", headers=auth("key-a"))).status_code == 200

    run(scenario())


def test_a_quota_refusal_is_answered_from_memory_until_it_runs_out() -> None:
    async def scenario() -> None:
        app, known, inner = gate()
        known.learn(digest("key-a"), "a")
        inner.release.set()
        known.refused("a", RateLimitError("tokens-per-minute limit reached; retry after 0.400 s",
                                          "tpm", 0.4))
        async with client(app) as http:
            refused = await http.post("/hold", headers=auth("key-a"))
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "tpm"
            assert inner.seen == 0
            # a retry with an Idempotency-Key may join a request admitted before; a GET reads
            joined = await http.post("/hold", headers={**auth("key-a"), "Idempotency-Key": "k"})
            assert joined.status_code == 200
            assert (await http.get("/hold", headers=auth("key-a"))).status_code == 200
            assert inner.seen == 2
            await asyncio.sleep(0.45)
            assert (await http.post("/hold", headers=auth("key-a"))).status_code == 200

    run(scenario())


def test_a_tenants_429s_are_paced_so_its_clients_come_back_at_a_bounded_rate() -> None:
    async def scenario() -> None:
        app, known, inner = gate()
        known.learn(digest("key-a"), "a")
        known.learn(digest("key-b"), "b")
        async with client(app) as http:
            waits = [int((await http.post("/refuse", headers=auth("key-a"))).headers[
                "retry-after"]) for _ in range(4 * REFUSALS_PER_S)]
            other = await http.post("/refuse", headers=auth("key-b"))
        assert waits == sorted(waits) and waits[0] == 1
        for seconds in range(1, max(waits) + 1):  # at most REFUSALS_PER_S come back a second
            assert sum(w <= seconds for w in waits) <= REFUSALS_PER_S * seconds + 1, seconds
        assert max(waits) >= 3  # 4 s of refusals at REFUSALS_PER_S: spread over ~4 s
        assert max(waits) <= MAX_RETRY_AFTER_S
        assert other.headers["retry-after"] == "1"  # another tenant is not paced by a's

    run(scenario())


def test_authentication_teaches_the_gate_keys_and_quota_refusals(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            known = KnownKeys()
            api_keys = ApiKeys(h.scripts, known)
            await add_tenants(h, Tenant(id="acme", rpm=1))
            secret = (await api_keys.create("acme")).secret
            assert known.tenant_of(f"Bearer {secret}".encode()) is None
            await api_keys.authenticate(secret, for_admission=True)
            assert known.tenant_of(f"Bearer {secret}".encode()) == "acme"
            assert known.tenant_of(b"Bearer another") is None
            assert known.refusal("acme") is None
            await h.queues.admit(make_request("acme", "r1", prompt_tokens=1, max_tokens=1))
            with pytest.raises(RateLimitError):
                await api_keys.authenticate(secret, for_admission=True)
            left_s, refusal, _ = known.refusal("acme")
            assert refusal.reason == "rpm" and 0 < left_s <= REFUSAL_MEMORY_S
            assert refusal.retry_after_s > REFUSAL_MEMORY_S  # the rpm window's: remembered less

    run(scenario())
