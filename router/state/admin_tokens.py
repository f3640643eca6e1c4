"""Admin tokens: the credentials of the admin API (router/admin/), apart from tenant keys.

Made by the CLI (``fairserve admin token-create``), shown once, stored as SHA-256 digests:
``fs:admintoken:<digest>`` (a hash: id, label, created_ms) and ``fs:admintokens`` (id ->
digest), at most ``MAX_ADMIN_TOKENS``, kept until revoked. A tenant's API key is never an admin
token (another prefix, another keyspace). Every token may do everything the admin API does.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from router.errors import ConflictError, NotFoundError
from router.state import keys
from router.state.api_keys import digest

if TYPE_CHECKING:
    import redis.asyncio as aioredis

TOKEN_PREFIX = "fsa-"
MAX_ADMIN_TOKENS = 100


@dataclass(frozen=True, slots=True)
class AdminToken:
    id: str
    label: str
    created_ms: int


class AdminTokens:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def create(self, label: str = "") -> tuple[AdminToken, str]:
        """A new token and its secret (shown once; only the digest is kept)."""
        if await self.client.hlen(keys.admin_tokens()) >= MAX_ADMIN_TOKENS:
            raise ConflictError(f"there are {MAX_ADMIN_TOKENS} admin tokens already: revoke "
                                "one first", param="label")
        token_id = secrets.token_hex(6)
        secret = f"{TOKEN_PREFIX}{token_id}-{secrets.token_urlsafe(32)}"
        token = AdminToken(token_id, label, int(time.time() * 1000))
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(keys.admin_token(digest(secret)), mapping={
            "id": token.id, "label": label, "created_ms": token.created_ms})
        pipe.hset(keys.admin_tokens(), token.id, digest(secret))
        await pipe.execute()
        return token, secret

    async def verify(self, secret: str | None) -> AdminToken | None:
        """The token of ``secret``, or None (no such token, or revoked)."""
        if not secret or not secret.startswith(TOKEN_PREFIX):
            return None
        found = cast(dict[bytes, bytes],
                     await self.client.hgetall(keys.admin_token(digest(secret))))
        if not found:
            return None
        return AdminToken(found[b"id"].decode(), found.get(b"label", b"").decode(),
                          int(found.get(b"created_ms", b"0")))

    async def list(self) -> list[AdminToken]:
        ids = cast(dict[bytes, bytes], await self.client.hgetall(keys.admin_tokens()))
        tokens = []
        for token_digest in ids.values():
            found = cast(dict[bytes, bytes],
                         await self.client.hgetall(keys.admin_token(token_digest.decode())))
            if found:
                tokens.append(AdminToken(found[b"id"].decode(), found.get(b"label", b"").decode(),
                                         int(found.get(b"created_ms", b"0"))))
        return sorted(tokens, key=lambda t: t.created_ms)

    async def revoke(self, token_id: str) -> None:
        token_digest = await self.client.hget(keys.admin_tokens(), token_id)
        if token_digest is None:
            raise NotFoundError(f"no admin token {token_id!r}", param="token_id")
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(keys.admin_token(token_digest.decode()))
        pipe.hdel(keys.admin_tokens(), token_id)
        await pipe.execute()
