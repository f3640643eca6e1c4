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
        max_streams: 256   # requests waited on at once (streamed or not), all routers
        max_resumes: 32    # GET resumes open at once
        api_keys:          # optional: keys known by their SHA-256 digest only
          - {id: 3f2a9c01, sha256: 9b7e...64 hex..., label: ci}

A file with ``api_keys`` is how a deployment bootstraps its tenants and keys from a Kubernetes
Secret without a secret ever being written down: ``fairserve tenants key-new ID`` makes a key
and prints the entry with its digest (``cluster/tenants_cli.py``). Loading reconciles
(``load_tenants``): the tenants the file lists follow the file's changes, CLI changes to other
fields stick, keys the file drops are revoked, a tenant it drops is disabled; a key id or digest
taken by another key is a conflict.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router.errors import ConflictError, InvalidRequestError, NotFoundError, StoredDataError
from router.state import keys
from router.state.adapters import NAME as MODEL_NAME
from router.state.api_keys import KEY_ID_HEX_CHARS, ApiKeys
from router.state.audit import AuditLog
from router.state.scripts import Script, Scripts

MAX_PRIORITY = 9
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_QUEUED = 1000
DEFAULT_MAX_STREAMS = 512
DEFAULT_MAX_RESUMES = 64
MAX_KEY_LABEL_CHARS = 200
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
KEY_ID = re.compile(rf"^[0-9a-f]{{{KEY_ID_HEX_CHARS}}}$")


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
    max_streams: int = Field(
        DEFAULT_MAX_STREAMS, ge=1,
        description="cap on requests the tenant's clients wait on at once, streamed or not, "
        "over all routers (429 with Retry-After beyond)")
    max_resumes: int = Field(
        DEFAULT_MAX_RESUMES, ge=1,
        description="cap on resumed reads (GET .../{id}) open at once, over all routers")
    cache_group: str | None = Field(
        None, description="tenants naming the same group share the prefix cache (each can tell "
        "what another in the group sent recently, from cached_tokens); none: the tenant's own "
        "partition, which no other tenant can probe")
    disabled: bool = Field(False, description="refuse new requests (queued ones still run)")
    models: list[str] | None = Field(
        None, max_length=256, description="the models (the base model, LoRA adapters) the tenant "
        "may use; any other is a 404 model_not_found; none: every model it can see")

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        try:
            return keys.check_tenant_id(value)
        except InvalidRequestError as exc:
            raise ValueError(exc.message) from None

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(MODEL_NAME.match(m) for m in value):
            raise ValueError("model names: letters, digits and ._:/- (at most 128, starting "
                             "with a letter or digit)")
        return value

    @field_validator("cache_group")
    @classmethod
    def _check_group(cls, value: str | None) -> str | None:
        if value is not None and not keys.TENANT_ID_PATTERN.match(value):
            raise ValueError("a cache group is named as a tenant is: 1-63 of a-z, 0-9, '_' "
                             "and '-'")
        return value

    def to_redis(self) -> dict[str, str]:
        """Field -> string; unset limits are absent (unlimited)."""
        fields: dict[str, str] = {}
        for name, value in self.model_dump(exclude={"id"}).items():
            if value is None:
                continue
            if isinstance(value, bool):
                fields[name] = "1" if value else "0"
            elif isinstance(value, list):  # models: comma-separated, as admit.lua reads them
                fields[name] = ",".join(value)
            else:
                fields[name] = value if isinstance(value, str) else repr(value)
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
        if "models" in raw:
            raw["models"] = [m for m in raw["models"].split(",") if m]
        try:
            return cls(id=tenant_id, **raw)
        except ValidationError as exc:
            bad = ", ".join(".".join(str(p) for p in e["loc"]) for e in exc.errors())
            raise StoredDataError(f"malformed tenant settings in {where}: {bad}") from None


class TenantKey(BaseModel):
    """An API key of a tenants file: its id and the SHA-256 digest of the whole key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description=f"the key id: {KEY_ID_HEX_CHARS} hex digits")
    sha256: str = Field(description="SHA-256 of the whole key, 64 lowercase hex digits")
    label: str = Field("", max_length=MAX_KEY_LABEL_CHARS)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if not KEY_ID.match(value):
            raise ValueError(f"must be {KEY_ID_HEX_CHARS} lowercase hex digits")
        return value

    @field_validator("sha256")
    @classmethod
    def _check_digest(cls, value: str) -> str:
        if not SHA256_HEX.match(value):
            raise ValueError("must be 64 lowercase hex digits (the digest, never the key)")
        return value


@dataclass(frozen=True, slots=True)
class TenantsDocument:
    tenants: list[Tenant]
    api_keys: list[tuple[str, TenantKey]]  # (tenant id, key)


def parse_tenants_yaml(text: str, source: str = "tenants file") -> TenantsDocument:
    """Tenants and their key digests from YAML (a ``tenants:`` list); errors name the entry
    and the field."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidRequestError(f"{source}: not valid YAML: {exc}", param="tenants") from None
    if not isinstance(document, dict) or not isinstance(document.get("tenants"), list):
        raise InvalidRequestError(f"{source}: expected a mapping with a 'tenants' list",
                                  param="tenants")
    tenants: list[Tenant] = []
    api_keys: list[tuple[str, TenantKey]] = []
    for index, entry in enumerate(document["tenants"]):
        where = f"tenants[{index}]"
        fields = dict(entry) if isinstance(entry, dict) else entry
        key_entries: Any = []
        if isinstance(fields, dict):
            key_entries = fields.pop("api_keys", None) or []
        tenant = validated(Tenant, fields, where, source)
        tenants.append(tenant)
        if not isinstance(key_entries, list):
            raise InvalidRequestError(f"{source}: {where}.api_keys: expected a list",
                                      param=f"{where}.api_keys")
        api_keys.extend((tenant.id, validated(TenantKey, k, f"{where}.api_keys[{i}]", source))
                        for i, k in enumerate(key_entries))
    for name, ids in (("tenant ids", [t.id for t in tenants]),
                      ("key ids", [k.id for _, k in api_keys]),
                      ("key digests", [k.sha256 for _, k in api_keys])):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise InvalidRequestError(f"{source}: duplicate {name} {duplicates}", param="tenants")
    return TenantsDocument(tenants, api_keys)


def validated(model: type[BaseModel], entry: Any, where: str = "", source: str = "") -> Any:
    """``entry`` as a ``model``; else ``InvalidRequestError`` naming the first bad field, as
    ``where.field`` (``where``: its place in a file), the message led by ``source``."""
    try:
        return model.model_validate(entry)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "entry"
        param = f"{where}.{field}" if where else field
        message = first["msg"].removeprefix("Value error, ")
        lead = f"{source}: " if source else ""
        raise InvalidRequestError(f"{lead}{param}: {message}", param=param) from None


def load_tenants_file(path: str | Path) -> TenantsDocument:
    path = Path(path)
    return parse_tenants_yaml(path.read_text(), source=str(path))


@dataclass(frozen=True, slots=True)
class LoadResult:
    num_created: int
    num_updated: int  # tenants whose file entry changed since the last load
    num_keys_added: int
    num_unchanged: int = 0  # tenants whose file entry did not change: left as they are
    num_keys_revoked: int = 0  # keys the file no longer lists
    num_released: int = 0  # tenants the file no longer lists: disabled, their file keys revoked

    @property
    def summary(self) -> str:
        return (f"{self.num_created} created, {self.num_updated} updated, {self.num_unchanged} "
                f"unchanged, {self.num_released} no longer in the file (disabled); "
                f"{self.num_keys_added} API keys added, {self.num_keys_revoked} revoked")


async def load_tenants(scripts: Scripts, document: TenantsDocument, prune: bool = True,
                       audit: AuditLog | None = None, actor: str = "file") -> LoadResult:
    """Reconcile Redis with a tenants file, as ``kubectl apply`` does with its last-applied
    configuration (``keys.file_tenants``: what the file last set on each tenant it owns):

    - a tenant of the file is created if missing; otherwise each setting the file changed since
      its last load is applied, and every other one is left as it is, so a change made with the
      CLI (``tenants set --disabled``) sticks across redeploys until the file changes that field;
    - its keys in the file are added; a key the file listed before and lists no more is revoked
      (keys made with the CLI are not the file's, and are left alone);
    - a tenant the file owned and no longer lists is disabled (what it has queued still runs)
      and its file keys are revoked;
    - tenants the file never listed are not touched.

    ``prune`` False (``fairserve tenants load`` without ``--prune``): the tenants the file owned
    and no longer lists are left as they are, so loading a partial file by hand never disables
    the rest; a deploy loads the whole file and prunes.

    Each change is written to ``audit`` (if given) as made by ``actor``.
    """
    client: aioredis.Redis = scripts.client
    store, api_keys = TenantStore(scripts), ApiKeys(scripts)
    raw = cast(dict[bytes, bytes], await client.hgetall(keys.file_tenants()))
    owned = {k.decode(): json.loads(v) for k, v in raw.items()}
    file_keys: dict[str, list[TenantKey]] = {}
    for tenant_id, key in document.api_keys:
        file_keys.setdefault(tenant_id, []).append(key)
    created = updated = unchanged = added = revoked = released = 0

    async def record(action: str, target: str, before: Any = None, after: Any = None) -> None:
        if audit is not None:
            await audit.record(actor, action, target, before, after)

    for tenant in document.tenants:
        applied = {"settings": tenant.model_dump(mode="json", exclude={"id"}),
                   "keys": sorted(k.id for k in file_keys.get(tenant.id, []))}
        last = owned.pop(tenant.id, None)
        before = await _current(store, tenant.id)
        outcome = await _apply(store, tenant, last["settings"] if last else None)
        created += outcome == "created"
        updated += outcome == "updated"
        unchanged += outcome == "unchanged"
        if outcome != "unchanged":
            await record(f"tenant.{outcome.removesuffix('d')}", tenant.id, before,
                         (await store.get(tenant.id)).model_dump(mode="json"))
        for key in file_keys.get(tenant.id, []):
            if await api_keys.add_digest(tenant.id, key.id, key.sha256, key.label):
                added += 1
                await record("key.create", tenant.id, None, {
                    "key_id": key.id, "label": key.label, "digest": key.sha256[:12]})
        for key_id in await _revoke(api_keys, tenant.id, set(last["keys"] if last else [])
                                    - set(applied["keys"])):
            revoked += 1
            await record("key.revoke", tenant.id, {"key_id": key_id})
        await client.hset(keys.file_tenants(), tenant.id, json.dumps(applied))
    for tenant_id, last in (owned.items() if prune else ()):
        for key_id in await _revoke(api_keys, tenant_id, set(last["keys"])):
            revoked += 1
            await record("key.revoke", tenant_id, {"key_id": key_id})
        before = await _current(store, tenant_id)
        with contextlib.suppress(NotFoundError):
            await store.update(tenant_id, disabled=True)
            await record("tenant.disable", tenant_id, before, {**(before or {}), "disabled": True})
        await client.hdel(keys.file_tenants(), tenant_id)
        released += 1
    return LoadResult(created, updated, added, unchanged, revoked, released)


async def _current(store: TenantStore, tenant_id: str) -> dict[str, Any] | None:
    """A tenant's settings now (None: there is no such tenant)."""
    try:
        return (await store.get(tenant_id)).model_dump(mode="json")
    except NotFoundError:
        return None


async def _apply(store: TenantStore, tenant: Tenant, last: dict[str, Any] | None) -> str:
    """A file's tenant onto Redis: "created", "updated" (the fields the file changed since
    ``last``, what it applied then) or "unchanged"."""
    if not await store.client.exists(keys.tenant(tenant.id)):
        await store.put(tenant)
        return "created"
    if last is None:  # a tenant made with the CLI that the file now takes over
        await store.put(tenant)
        return "updated"
    wanted = tenant.model_dump(mode="json", exclude={"id"})
    changed = {name: value for name, value in wanted.items() if last.get(name) != value}
    if not changed:
        return "unchanged"
    await store.update(tenant.id, **changed)
    return "updated"


async def _revoke(api_keys: ApiKeys, tenant_id: str, key_ids: set[str]) -> list[str]:
    """The keys of ``key_ids`` that were revoked (the others were gone already)."""
    done = []
    for key_id in sorted(key_ids):
        with contextlib.suppress(NotFoundError):
            await api_keys.revoke(tenant_id, key_id)
            done.append(key_id)
    return done


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
