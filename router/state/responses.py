"""Stored Responses (``POST /v1/responses`` with ``store``), per tenant in Redis.

A stored response keeps what its next turn needs (``previous_response_id``): the
conversation up to and including its own output, as chat messages, beside the response
object ``GET /v1/responses/{id}`` returns. One JSON string per response,
``fs:{t}:resp:<id>``, expiring after ``responses.ttl_s``; the tenant's index of them,
``fs:{t}:resps`` (ZSET id -> created ms), holds at most ``responses.max_per_tenant``: past it
the oldest are deleted. A conversation is at most ``responses.max_bytes`` as JSON (refused
before it runs, naming the field). So any router serves the next turn, a router restart loses
nothing, and another tenant's id is not found: its keys are under its own tenant.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from router.state import keys


class ResponsesSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ttl_s: int = Field(30 * 86400, ge=60, le=365 * 86400,
                       description="how long a stored response (and its conversation) is kept")
    max_per_tenant: int = Field(1000, ge=1, le=1_000_000,
                                description="stored responses per tenant; past it the oldest go")
    max_bytes: int = Field(512 * 1024, ge=1024, le=16 * 1024 * 1024,
                           description="the largest conversation (as JSON) a response may "
                           "carry on; a longer one is refused before it runs")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as GET returns it
    messages: list[dict[str, Any]]  # the conversation through its output (chat messages)


class ResponseStore:
    def __init__(self, client: aioredis.Redis, settings: ResponsesSettings | None = None) -> None:
        self.client = client
        self.settings = settings or ResponsesSettings()

    async def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        if not keys.RESPONSE_ID_PATTERN.match(response_id):
            return None
        raw = cast(bytes | None, await self.client.get(keys.response(tenant_id, response_id)))
        if raw is None:
            return None
        data = json.loads(raw)
        return StoredResponse(data["response"], data["messages"])

    async def put(self, tenant_id: str, stored: StoredResponse) -> None:
        response_id = stored.response["id"]
        now_ms = int(time.time() * 1000)
        index = keys.responses(tenant_id)
        ttl = self.settings.ttl_s
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(keys.response(tenant_id, response_id),
                     json.dumps({"response": stored.response, "messages": stored.messages}),
                     ex=ttl)
            pipe.zadd(index, {response_id: now_ms})
            pipe.zremrangebyscore(index, "-inf", now_ms - ttl * 1000)  # expired by now
            pipe.zrange(index, 0, -self.settings.max_per_tenant - 1)  # past the bound
            pipe.expire(index, ttl)
            replies = await pipe.execute()
        oldest = [m.decode() for m in replies[3]]
        if oldest:
            await self.client.delete(*(keys.response(tenant_id, r) for r in oldest))
            await self.client.zrem(index, *oldest)

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        if not keys.RESPONSE_ID_PATTERN.match(response_id):
            return False
        deleted = await self.client.delete(keys.response(tenant_id, response_id))
        await self.client.zrem(keys.responses(tenant_id), response_id)
        return bool(deleted)
