"""Builders for router tests: a harness of real clients on the session's redis-server, a
manual clock, requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis

from router.config import QueueSettings
from router.dispatch.streams import ResponseStreams
from router.messages import AdmitRequest
from router.state.api_keys import ApiKeys
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore

T = TypeVar("T")

# 2026-12-02 12:00:00 UTC, in ms: mid-day, so a test can run to midnight on purpose
NOON_MS = 1_796_212_800_000


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class ManualClock:
    """Time in ms that moves only when a test says so (passed to the scripts as ARGV)."""

    def __init__(self, now_ms: int = NOON_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: float) -> None:
        self.now_ms += int(ms)


@dataclass
class Harness:
    client: aioredis.Redis
    scripts: Scripts
    tenants: TenantStore
    api_keys: ApiKeys
    queues: TenantQueues
    streams: ResponseStreams


@contextlib.asynccontextmanager
async def harness(
    url: str, clock: ManualClock | None = None, settings: QueueSettings | None = None
) -> AsyncIterator[Harness]:
    client = connect(url)
    scripts = Scripts(client, clock)
    try:
        yield Harness(client, scripts, TenantStore(scripts), ApiKeys(scripts),
                      TenantQueues(scripts, settings), ResponseStreams(scripts))
    finally:
        await client.aclose()


def make_request(tenant_id: str, request_id: str, prompt_tokens: int = 10, max_tokens: int = 20,
                 **extra: Any) -> AdmitRequest:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": request_id}],
                       "max_tokens": max_tokens})
    return AdmitRequest(tenant_id, request_id, prompt_tokens, max_tokens, body, **extra)


async def add_tenants(h: Harness, *tenants: Tenant) -> None:
    for tenant in tenants:
        await h.tenants.add(tenant)
