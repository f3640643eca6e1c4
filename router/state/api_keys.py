"""API keys: created once and shown once, stored only as SHA-256 digests.

A key reads ``fs-<key id>-<secret>``: the key id (8 hex digits) names it for listing and
revocation, the secret is 32 random bytes. Redis keeps ``fs:apikey:<sha256 hex>`` -> tenant and
``fs:{t}:keys`` key id -> digest; lookup is by digest, and the stored digest is compared with
the presented one in constant time. No cache: a revoked key is refused on the next request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import redis.asyncio as aioredis

from router.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    StoredDataError,
)
from router.state import keys
from router.state.quota_check import DAY_MS, refuse_if_exhausted
from router.state.scripts import Script, Scripts

if TYPE_CHECKING:
    from router.api.tenant_gate import KnownKeys

KEY_PREFIX = "fs-"
KEY_ID_HEX_CHARS = 8
KEY_SECRET_BYTES = 32
MAX_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class CreatedKey:
    tenant_id: str
    key_id: str
    secret: str  # the whole key; shown to the operator once, never stored


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from."""

    tenant_id: str
    key_id: str


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh (key id, whole key); nothing is stored."""
    key_id = secrets.token_hex(KEY_ID_HEX_CHARS // 2)
    return key_id, f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(KEY_SECRET_BYTES)}"


class ApiKeys:
    def __init__(self, scripts: Scripts, known: KnownKeys | None = None) -> None:
        self.scripts = scripts
        self.client: aioredis.Redis = scripts.client
        self.known = known  # told of every key that proves to be a tenant's (the tenant gate)

    async def create(self, tenant_id: str, label: str = "") -> CreatedKey:
        keys.check_tenant_id(tenant_id)
        key_id, secret = new_key()
        reply = await self.scripts.run(Script.KEY_CREATE, tenant_id, key_id, digest(secret), label)
        if reply[0] == b"missing":
            raise NotFoundError(f"unknown tenant {tenant_id!r}", param="tenant")
        if reply[0] == b"exists":  # a random collision: vanishingly rare, never silent
            raise ConflictError("key id collision; create the key again", param="key_id")
        return CreatedKey(tenant_id, key_id, secret)

    async def add_digest(self, tenant_id: str, key_id: str, sha256: str, label: str = "") -> bool:
        """Store a key known only by its digest (a tenants file's ``api_keys``); True if it was
        added, False if that very key was there already. The same key id or digest with
        anything else is a conflict, never an overwrite."""
        keys.check_tenant_id(tenant_id)
        reply = await self.scripts.run(Script.KEY_CREATE, tenant_id, key_id, sha256, label)
        if reply[0] == b"missing":
            raise NotFoundError(f"unknown tenant {tenant_id!r}", param="tenant")
        if reply[0] == b"ok":
            return True
        stored = cast(bytes | None, await self.client.hget(keys.api_keys(tenant_id), key_id))
        if stored is not None and stored.decode() == sha256:
            return False
        raise ConflictError(f"key {key_id!r} of tenant {tenant_id!r}: its id or digest is taken "
                            "by another key", param="api_keys")

    async def revoke(self, tenant_id: str, key_id: str) -> None:
        keys.check_tenant_id(tenant_id)
        reply = await self.scripts.run(Script.KEY_REVOKE, tenant_id, key_id)
        if reply[0] == b"missing":
            raise NotFoundError(f"tenant {tenant_id!r} has no key {key_id!r}", param="key_id")

    async def list(self, tenant_id: str) -> list[str]:
        """Key ids of a tenant (the secrets are not kept)."""
        key_ids = cast(list[bytes], await self.client.hkeys(keys.api_keys(tenant_id)))
        return sorted(k.decode() for k in key_ids)

    async def authenticate(self, api_key: str | None, tenant_id: str | None = None,
                           for_admission: bool = False) -> Principal:
        """The tenant of a key. ``tenant_id``: the tenant the caller claims, if any; a key of
        another tenant is refused (403) without saying whether that tenant exists.
        ``for_admission``: a request to be queued follows; a tenant past its rpm, tpm or daily
        budget is refused now (429), before the router tokenizes anything
        (``router/state/quota_check.py``), in the round trip that reads ``disabled``."""
        if not api_key:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        if len(api_key) > MAX_KEY_CHARS or not api_key.isascii():
            raise AuthenticationError("invalid API key")
        presented = digest(api_key)
        where = keys.api_key(presented)
        record = cast(dict[bytes, bytes], await self.client.hgetall(where))
        if not record or not hmac.compare_digest(record.get(b"digest", b""), presented.encode()):
            raise AuthenticationError("invalid API key")
        try:
            owner = keys.check_tenant_id(record[b"tenant"].decode())
            key_id = record[b"key_id"].decode()
        except (KeyError, UnicodeDecodeError, InvalidRequestError):
            raise StoredDataError(f"malformed API key record {where}") from None
        if self.known is not None:
            self.known.learn(presented, owner)
        if tenant_id is not None and keys.check_tenant_id(tenant_id) != owner:
            raise PermissionDeniedError("this API key does not belong to that tenant",
                                        param="tenant")
        if not for_admission:
            disabled = await self.client.hget(keys.tenant(owner), "disabled")
            _check_enabled(owner, disabled)
            return Principal(owner, key_id)
        now_ms = time.time() * 1000
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.tenant(owner), "disabled", "rpm", "tpm", "daily_tokens")
        pipe.hmget(keys.state(owner), "rpm_tat", "tpm_tat")
        pipe.get(keys.budget(owner, int(now_ms // DAY_MS)))
        tenant, tats, used = await pipe.execute()
        _check_enabled(owner, tenant[0])
        try:
            refuse_if_exhausted(tenant[1:], tats, used, now_ms)
        except RateLimitError as refusal:
            if self.known is not None:  # no request of the tenant gets through meanwhile
                self.known.refused(owner, refusal)
            raise
        return Principal(owner, key_id)


def _check_enabled(tenant_id: str, disabled: bytes | None) -> None:
    if disabled not in (None, b"0"):  # a malformed flag fails closed
        raise PermissionDeniedError(f"tenant {tenant_id!r} is disabled", param="tenant")
