"""Admin tokens: the credentials of the admin API (router/admin/), apart from tenant keys.

Made by the CLI (``fairserve admin token-create``), shown once, stored as SHA-256 digests:
``fs:admintoken:<digest>`` (a hash: id, label, created_ms) and ``fs:admintokens`` (id ->
digest), at most ``MAX_ADMIN_TOKENS``, kept until revoked. A tenant's API key is never an admin
token (another prefix, another keyspace). Every token may do everything the admin API does.

On Kubernetes a file of digests (``router.api.admin_tokens_file``, from a Secret; ``fairserve
admin token-new`` makes a token and its entry) is reconciled at every deploy
(``load_token_file``): its tokens are added, and a token it listed before and lists no more is
revoked (``fs:admintokens:file`` remembers which are the file's; tokens made with the CLI are
left alone).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import WatchError

from router.errors import ConflictError, InvalidRequestError, NotFoundError
from router.state import keys
from router.state.api_keys import digest

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

TOKEN_PREFIX = "fsa-"
MAX_ADMIN_TOKENS = 100


@dataclass(frozen=True, slots=True)
class AdminToken:
    id: str
    label: str
    created_ms: int


class TokenEntry(BaseModel):
    """A token of an admin tokens file: its id, label and the SHA-256 digest of its secret."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[0-9a-f]{12}$")
    label: str = Field("", max_length=200)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class TokenFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    admin_tokens: list[TokenEntry] = Field(default_factory=list, max_length=MAX_ADMIN_TOKENS)


def new_token() -> tuple[str, str]:
    """A fresh (token id, secret); nothing is stored."""
    token_id = secrets.token_hex(6)
    return token_id, f"{TOKEN_PREFIX}{token_id}-{secrets.token_urlsafe(32)}"


class AdminTokens:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def create(self, label: str = "") -> tuple[AdminToken, str]:
        """A new token and its secret (shown once; only the digest is kept). The count is
        checked and the token stored in one transaction (WATCH), so concurrent creators cannot
        pass ``MAX_ADMIN_TOKENS`` together."""
        token_id, secret = new_token()
        while True:
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(keys.admin_tokens())
                    if await pipe.hlen(keys.admin_tokens()) >= MAX_ADMIN_TOKENS:
                        raise ConflictError(f"there are {MAX_ADMIN_TOKENS} admin tokens "
                                            "already: revoke one first", param="label")
                    pipe.multi()
                    token = self._store(pipe, token_id, label, digest(secret))
                    await pipe.execute()
                    return token, secret
                except WatchError:  # another change came between: count again
                    continue

    @staticmethod
    def _store(pipe: Pipeline, token_id: str, label: str, token_digest: str) -> AdminToken:
        token = AdminToken(token_id, label, int(time.time() * 1000))
        pipe.hset(keys.admin_token(token_digest), mapping={
            "id": token.id, "label": label, "created_ms": token.created_ms})
        pipe.hset(keys.admin_tokens(), token.id, token_digest)
        return token

    async def load_file(self, path: str | Path) -> tuple[list[str], list[str]]:
        """Reconcile with an admin tokens file: (ids added, ids revoked)."""
        try:
            document = TokenFile.model_validate(yaml.safe_load(Path(path).read_text()) or {})
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"{path}: {field}: {first['msg']}", param=field) from None
        known = {k.decode(): v.decode() for k, v in cast(
            dict[bytes, bytes], await self.client.hgetall(keys.admin_tokens())).items()}
        before = {m.decode() for m in cast(set[bytes], await self.client.smembers(
            keys.file_admin_tokens()))}
        added = []
        for entry in document.admin_tokens:
            if known.get(entry.id) != entry.sha256:
                if entry.id in known:  # the file changed a token's secret: the old one goes
                    await self.revoke(entry.id)
                pipe = self.client.pipeline(transaction=True)
                self._store(pipe, entry.id, entry.label, entry.sha256)
                await pipe.execute()
                added.append(entry.id)
        listed = {e.id for e in document.admin_tokens}
        revoked = []
        for token_id in sorted(before - listed):
            if token_id in known:
                await self.revoke(token_id)
                revoked.append(token_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(keys.file_admin_tokens())
        if listed:
            pipe.sadd(keys.file_admin_tokens(), *sorted(listed))
        await pipe.execute()
        return added, revoked

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
