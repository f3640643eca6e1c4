"""The admin API (``/admin/v1/...``): what ``fairserve tenants``, ``usage`` and ``audit`` do,
over HTTP, for operators who have no line to Redis.

Every router serves it on ``router.api.admin_host``:``admin_port`` (loopback by default; the
routers of one machine share the port), never on the tenants' port. Only admin tokens
(router/state/admin_tokens.py) are let in: a tenant's API key is a 401. Each change is written
to the audit log with the token as its actor (``admin:<token id>``). Errors are OpenAI's error
bodies, as on the tenants' API. The document: ``GET /admin/openapi.json``.

``GET /admin/v1/organization/usage/completions`` answers in the shape of OpenAI's Usage API
(``bucket_width`` 1h or 1d, ``group_by`` ``project_id`` (the tenant) and ``model``), so
dashboards that read OpenAI's usage read fairserve's.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the routes' annotations at run
# time, and `Actor` (the admin-token dependency) is a name local to each route group

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from router.errors import AuthenticationError, InvalidRequestError, RouterError, error_body
from router.state import keys
from router.state.admin_tokens import AdminTokens
from router.state.api_keys import ApiKeys, digest
from router.state.audit import MAX_READ, AuditLog, change_action
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore
from router.state.usage import UsageReader, UsageRow

BUCKETS_MS = {"1h": keys.HOUR_MS, "1d": 86_400_000}


class TenantChange(BaseModel):
    """Settings to change (those left out stay as they are); see ``Tenant``."""

    model_config = ConfigDict(extra="forbid")

    weight: float | None = None
    priority: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    daily_tokens: int | None = None
    max_tokens: int | None = None
    max_queued: int | None = None
    max_streams: int | None = None
    max_resumes: int | None = None
    cache_group: str | None = None
    models: list[str] | None = None
    disabled: bool | None = None


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str = Field("", max_length=200)


def _error(exc: RouterError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


@dataclass(frozen=True, slots=True)
class _Stores:
    client: Any
    tenants: TenantStore
    api_keys: ApiKeys
    usage: UsageReader
    audit: AuditLog


def admin_app(scripts: Scripts, audit: AuditLog) -> FastAPI:
    client = scripts.client
    stores = _Stores(client, TenantStore(scripts), ApiKeys(scripts), UsageReader(client), audit)
    tokens = AdminTokens(client)
    app = FastAPI(title="fairserve admin API", openapi_url="/admin/openapi.json",
                  docs_url=None, redoc_url=None)

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "path"))
        return _error(InvalidRequestError(f"{field}: {first['msg']}", param=field or None))

    async def actor(authorization: Annotated[str | None, Header()] = None) -> str:
        scheme, _, secret = (authorization or "").partition(" ")
        token = await tokens.verify(secret.strip() if scheme.lower() == "bearer" else None)
        if token is None:
            raise AuthenticationError("an admin token is required (fairserve admin "
                                      "token-create); tenant API keys are not accepted here")
        return f"admin:{token.id}"

    who = Annotated[str, Depends(actor)]
    _tenant_routes(app, stores, who)
    _key_routes(app, stores, who)
    _report_routes(app, stores, who)
    return app


def _tenant_routes(app: FastAPI, stores: _Stores, Actor: Any) -> None:  # noqa: N803
    tenants, audit = stores.tenants, stores.audit

    @app.get("/admin/v1/tenants")
    async def list_tenants(_: Actor) -> dict[str, Any]:
        return {"object": "list",
                "data": [t.model_dump(mode="json") for t in await tenants.all()]}

    @app.post("/admin/v1/tenants", status_code=201)
    async def create_tenant(tenant: Tenant, who: Actor) -> dict[str, Any]:
        await tenants.add(tenant)
        after = tenant.model_dump(mode="json")
        await audit.record(who, "tenant.create", tenant.id, None, after)
        return after

    @app.get("/admin/v1/tenants/{tenant_id}")
    async def get_tenant(tenant_id: str, _: Actor) -> dict[str, Any]:
        return (await tenants.get(tenant_id)).model_dump(mode="json")

    @app.patch("/admin/v1/tenants/{tenant_id}")
    async def update_tenant(tenant_id: str, change: TenantChange, who: Actor) -> dict[str, Any]:
        changes = change.model_dump(exclude_unset=True)
        if not changes:
            raise InvalidRequestError("nothing to change", param="body")
        return await _update(tenant_id, changes, who)

    @app.post("/admin/v1/tenants/{tenant_id}/disable")
    async def disable_tenant(tenant_id: str, who: Actor) -> dict[str, Any]:
        return await _update(tenant_id, {"disabled": True}, who)

    async def _update(tenant_id: str, changes: dict[str, Any], who: str) -> dict[str, Any]:
        before = (await tenants.get(tenant_id)).model_dump(mode="json")
        after = (await tenants.update(tenant_id, **changes)).model_dump(mode="json")
        await audit.record(who, change_action(changes), tenant_id, before, after)
        return after


def _key_routes(app: FastAPI, stores: _Stores, Actor: Any) -> None:  # noqa: N803
    api_keys, audit = stores.api_keys, stores.audit

    @app.post("/admin/v1/tenants/{tenant_id}/keys", status_code=201)
    async def create_key(tenant_id: str, body: KeyRequest, who: Actor) -> dict[str, Any]:
        created = await api_keys.create(tenant_id, body.label)
        prefix = digest(created.secret)[:12]
        await audit.record(who, "key.create", tenant_id, None,
                           {"key_id": created.key_id, "label": body.label, "digest": prefix})
        return {"tenant": tenant_id, "key_id": created.key_id, "label": body.label,
                "digest_prefix": prefix, "key": created.secret,
                "note": "shown once: only its SHA-256 digest is stored"}

    @app.get("/admin/v1/tenants/{tenant_id}/keys")
    async def list_keys(tenant_id: str, _: Actor,
                        digest_prefix: Annotated[str, Query(max_length=64)] = ""
                        ) -> dict[str, Any]:
        await stores.tenants.get(tenant_id)  # an unknown tenant is a 404
        stored = await stores.client.hgetall(keys.api_keys(tenant_id))
        data = [{"key_id": k.decode(), "digest_prefix": v.decode()[:12]}
                for k, v in sorted(stored.items()) if v.decode().startswith(digest_prefix)]
        return {"object": "list", "data": data}

    @app.delete("/admin/v1/tenants/{tenant_id}/keys/{key_id}")
    async def revoke_key(tenant_id: str, key_id: str, who: Actor) -> dict[str, Any]:
        await api_keys.revoke(tenant_id, key_id)
        await audit.record(who, "key.revoke", tenant_id, {"key_id": key_id})
        return {"key_id": key_id, "revoked": True}


def _report_routes(app: FastAPI, stores: _Stores, Actor: Any) -> None:  # noqa: N803
    usage, audit = stores.usage, stores.audit

    @app.get("/admin/v1/usage")
    async def read_usage(
            _: Actor, since_ms: Annotated[int, Query(ge=0)],
            until_ms: Annotated[int, Query(ge=1)],
            tenant: Annotated[list[str] | None, Query()] = None,
            group_by: Annotated[str, Query()] = "tenant,model,hour") -> dict[str, Any]:
        groups = [g for g in group_by.split(",") if g]
        rows = await usage.read(since_ms, until_ms, tenant, groups)
        return {"object": "list", "data": [r.as_dict(groups) for r in rows]}

    @app.get("/admin/v1/organization/usage/completions")
    async def openai_usage(
            _: Actor, start_time: Annotated[int, Query(ge=0)],
            end_time: Annotated[int | None, Query(ge=1)] = None,
            bucket_width: Annotated[Literal["1h", "1d"], Query()] = "1d",
            group_by: Annotated[list[str] | None, Query()] = None,
            project_ids: Annotated[list[str] | None, Query()] = None,
            models: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        """OpenAI's Usage API (completions): the tenant is the project."""
        until = (end_time * 1000) if end_time else int(time.time() * 1000)
        if until <= start_time * 1000:
            raise InvalidRequestError("end_time must be after start_time", param="end_time")
        wanted = set(group_by or [])
        groups = [g for g, o in (("tenant", "project_id"), ("model", "model")) if o in wanted]
        rows = await usage.read(start_time * 1000, until, project_ids,
                                [*groups, "hour" if bucket_width == "1h" else "day"])
        return usage_page([r for r in rows if not models or r.model in models],
                          BUCKETS_MS[bucket_width])

    @app.get("/admin/v1/audit")
    async def read_audit(_: Actor, since_ms: Annotated[int, Query(ge=0)] = 0,
                         until_ms: Annotated[int | None, Query(ge=1)] = None,
                         limit: Annotated[int, Query(ge=1, le=MAX_READ)] = 1_000
                         ) -> dict[str, Any]:
        entries = await audit.read(since_ms, until_ms, limit)
        return {"object": "list", "data": [e.as_dict() for e in entries]}


def usage_page(rows: list[UsageRow], width_ms: int) -> dict[str, Any]:
    """Usage rows (grouped by hour or day) as a page of OpenAI's usage buckets."""
    buckets: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        assert row.start_ms is not None
        buckets.setdefault(row.start_ms, []).append({
            "object": "organization.usage.completions.result",
            "input_tokens": row.counts.get("prompt_tokens", 0),
            "output_tokens": row.counts.get("completion_tokens", 0),
            "input_cached_tokens": row.counts.get("cached_tokens", 0),
            "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": row.counts.get("requests", 0),
            "project_id": row.tenant or None, "user_id": None, "api_key_id": None,
            "model": row.model or None, "batch": None})
    data = [{"object": "bucket", "start_time": start // 1000,
             "end_time": (start + width_ms) // 1000, "results": results}
            for start, results in sorted(buckets.items())]
    return {"object": "page", "data": data, "has_more": False, "next_page": None}
