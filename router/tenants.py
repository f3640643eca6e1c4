"""Tenants: their settings (weight, priority class, quotas, caps), kept in Redis.

A tenant's settings live in the HASH ``fs:{<tenant>}:tenant``; the admission and grant scripts
read them on every call, so a change (``fairserve tenants set``) applies to the next request.
Limits left unset are unlimited. Tenants can be loaded from a YAML file::

    tenants:
      - id: acme
        weight: 2
        priority: 1
        rpm: 600
        tpm: 200000
        daily_tokens: 5000000
        max_tokens: 2048
        max_queued: 500
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router import keys
from router.errors import ConflictError, InvalidRequestError, NotFoundError, StoredDataError
from router.scripts import Script, Scripts

MAX_PRIORITY = 9
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_QUEUED = 1000


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="tenant id: 1-63 of a-z, 0-9, '_' and '-'")
    weight: float = Field(1.0, gt=0, le=1e6, description="share of capacity under contention")
    priority: int = Field(
        0, ge=0, le=MAX_PRIORITY,
        description="strict priority class: backlog of a higher class is always granted first",
    )
    rpm: int | None = Field(None, ge=1, description="requests per minute (GCRA); None: unlimited")
    tpm: int | None = Field(
        None, ge=1,
        description="tokens per minute, counted as prompt + max_tokens at admission and settled "
        "to actual use at completion; None: unlimited",
    )
    daily_tokens: int | None = Field(
        None, ge=1, description="token budget per UTC day (reserved, then settled); None: unlimited"
    )
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="cap on a request's max_tokens")
    max_queued: int = Field(DEFAULT_MAX_QUEUED, ge=1, description="cap on requests waiting in queue")
    disabled: bool = Field(False, description="refuse new requests (queued ones still run)")

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        try:
            return keys.check_tenant_id(value)
        except InvalidRequestError as exc:
            raise ValueError(exc.message) from None

    def to_redis(self) -> dict[str, str]:
        """Field -> string; unset limits are absent (unlimited)."""
        fields: dict[str, str] = {}
        for name, value in self.model_dump(exclude={"id"}).items():
            if value is None:
                continue
            fields[name] = ("1" if value else "0") if isinstance(value, bool) else repr(value)
        return fields

    @classmethod
    def from_redis(cls, tenant_id: str, fields: dict[bytes, bytes]) -> Tenant:
        where = keys.tenant(tenant_id)
        try:
            raw: dict[str, Any] = {k.decode(): v.decode() for k, v in fields.items()}
        except UnicodeDecodeError:
            raise StoredDataError(f"malformed tenant settings in {where}: not UTF-8") from None
        if "disabled" in raw:
            if raw["disabled"] not in ("0", "1"):
                raise StoredDataError(f"malformed tenant settings in {where}: disabled")
            raw["disabled"] = raw["disabled"] == "1"
        try:
            return cls(id=tenant_id, **raw)
        except ValidationError as exc:
            bad = ", ".join(".".join(str(p) for p in e["loc"]) for e in exc.errors())
            raise StoredDataError(f"malformed tenant settings in {where}: {bad}") from None


def parse_tenants_yaml(text: str, source: str = "tenants file") -> list[Tenant]:
    """Tenants from YAML (a ``tenants:`` list); errors name the entry and the field."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidRequestError(f"{source}: not valid YAML: {exc}", param="tenants") from None
    if not isinstance(document, dict) or not isinstance(document.get("tenants"), list):
        raise InvalidRequestError(f"{source}: expected a mapping with a 'tenants' list",
                                  param="tenants")
    tenants: list[Tenant] = []
    for index, entry in enumerate(document["tenants"]):
        try:
            tenants.append(Tenant.model_validate(entry))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "entry"
            raise InvalidRequestError(
                f"{source}: tenants[{index}].{field}: {first['msg']}",
                param=f"tenants[{index}].{field}",
            ) from None
    ids = [t.id for t in tenants]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise InvalidRequestError(f"{source}: duplicate tenant ids {duplicates}", param="tenants")
    return tenants


def load_tenants_file(path: str | Path) -> list[Tenant]:
    path = Path(path)
    return parse_tenants_yaml(path.read_text(), source=str(path))


class TenantStore:
    """Create, read and change tenants in Redis."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.client: aioredis.Redis = scripts.client

    async def add(self, tenant: Tenant) -> None:
        reply = await self._put(tenant, "create")
        if reply[0] == b"exists":
            raise ConflictError(f"tenant {tenant.id!r} exists", param="id")

    async def put(self, tenant: Tenant) -> bool:
        """Create or replace; True if it was created."""
        reply = await self._put(tenant, "upsert")
        return bool(reply[1] == b"created")

    async def update(self, tenant_id: str, **changes: Any) -> Tenant:
        current = await self.get(tenant_id)
        try:
            changed = Tenant.model_validate({**current.model_dump(), **changes})
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"{field}: {first['msg']}", param=field) from None
        reply = await self._put(changed, "update")
        if reply[0] == b"missing":
            raise NotFoundError(f"unknown tenant {tenant_id!r}", param="tenant")
        return changed

    async def _put(self, tenant: Tenant, mode: str) -> list[Any]:
        settings = json.dumps(tenant.to_redis())
        return list(await self.scripts.run(Script.TENANT_PUT, tenant.id, settings, mode))

    async def get(self, tenant_id: str) -> Tenant:
        fields = cast(dict[bytes, bytes], await self.client.hgetall(keys.tenant(tenant_id)))
        if not fields:
            raise NotFoundError(f"unknown tenant {tenant_id!r}", param="tenant")
        return Tenant.from_redis(tenant_id, fields)

    async def all(self) -> list[Tenant]:
        members = cast(set[bytes], await self.client.smembers(keys.tenants()))
        ids = sorted(m.decode() for m in members)
        return [await self.get(tenant_id) for tenant_id in ids]

    async def load(self, tenants: list[Tenant]) -> tuple[int, int]:
        """Upsert every tenant of a file; returns (created, updated)."""
        created = 0
        for tenant in tenants:
            created += await self.put(tenant)
        return created, len(tenants) - created
