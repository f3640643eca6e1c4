"""The CLI over the admin API (``--admin-url``), for operators with no line to Redis: the same
calls the CLI makes on the Redis stores, made over HTTP with an admin token
(``$FAIRSERVE_ADMIN_TOKEN``, or ``--admin-token-file``). The changes are audited by the
server, under the token."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import httpx

from router.errors import RouterError
from router.state.api_keys import CreatedKey
from router.state.tenants import Tenant

ADMIN_URL_ENV = "FAIRSERVE_ADMIN_URL"
ADMIN_TOKEN_ENV = "FAIRSERVE_ADMIN_TOKEN"
TIMEOUT_S = 30.0


def add_admin_url_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin-url", default=os.environ.get(ADMIN_URL_ENV) or None,
                        help="speak to the admin API at this URL (a router's admin port) "
                        f"instead of Redis (default: ${ADMIN_URL_ENV}); the token comes from "
                        f"${ADMIN_TOKEN_ENV} or --admin-token-file")
    parser.add_argument("--admin-token-file", type=Path, default=None,
                        help="a file holding the admin token")


class AdminHttp:
    def __init__(self, args: argparse.Namespace) -> None:
        token = (args.admin_token_file.read_text().strip() if args.admin_token_file
                 else os.environ.get(ADMIN_TOKEN_ENV, ""))
        if not token:
            raise RouterError(f"--admin-url needs an admin token: ${ADMIN_TOKEN_ENV} or "
                              "--admin-token-file (fairserve admin token-create makes one)")
        self.http = httpx.AsyncClient(base_url=args.admin_url.rstrip("/"), timeout=TIMEOUT_S,
                                      headers={"Authorization": f"Bearer {token}"})

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            reply = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RouterError(f"cannot reach the admin API at {self.http.base_url}: "
                              f"{exc}") from None
        body = reply.json() if reply.headers.get("content-type", "").startswith(
            "application/json") else {}
        if reply.status_code >= 400:
            error = body.get("error") or {}
            raise RouterError(f"{reply.status_code}: {error.get('message') or reply.text}",
                              error.get("param"))
        return body

    async def aclose(self) -> None:
        await self.http.aclose()


class HttpTenants:
    """``TenantStore``'s calls the CLI makes, over the admin API."""

    def __init__(self, admin: AdminHttp) -> None:
        self.admin = admin

    async def add(self, tenant: Tenant) -> None:
        await self.admin.call("POST", "/admin/v1/tenants", json=tenant.model_dump(mode="json"))

    async def update(self, tenant_id: str, **changes: Any) -> Tenant:
        return Tenant.model_validate(await self.admin.call(
            "PATCH", f"/admin/v1/tenants/{tenant_id}", json=changes))

    async def get(self, tenant_id: str) -> Tenant:
        return Tenant.model_validate(await self.admin.call("GET",
                                                           f"/admin/v1/tenants/{tenant_id}"))

    async def all(self) -> list[Tenant]:
        body = await self.admin.call("GET", "/admin/v1/tenants")
        return [Tenant.model_validate(t) for t in body["data"]]


class HttpKeys:
    """``ApiKeys``' calls the CLI makes, over the admin API."""

    def __init__(self, admin: AdminHttp) -> None:
        self.admin = admin

    async def create(self, tenant_id: str, label: str = "") -> CreatedKey:
        body = await self.admin.call("POST", f"/admin/v1/tenants/{tenant_id}/keys",
                                     json={"label": label})
        return CreatedKey(tenant_id, body["key_id"], body["key"])

    async def revoke(self, tenant_id: str, key_id: str) -> None:
        await self.admin.call("DELETE", f"/admin/v1/tenants/{tenant_id}/keys/{key_id}")

    async def list(self, tenant_id: str) -> list[str]:
        body = await self.admin.call("GET", f"/admin/v1/tenants/{tenant_id}/keys")
        return [k["key_id"] for k in body["data"]]


class NoAdapters:
    """Adapters are managed with a line to Redis only."""

    def __getattr__(self, name: str) -> Any:
        raise RouterError("adapters are managed with --redis-url, not over the admin API")
