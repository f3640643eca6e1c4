"""The admin API on the real cluster's routers (their admin port, router/admin/): a tenant key
is a 401 there and the tenants' port has no admin routes; a tenant created there uses the API
with its key; disabling it stops its next request; the audit names the token; the usage API
shows the tenant's request."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from router.state.admin_tokens import AdminTokens
from router.state.redis_client import connect
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _admin_token(e2e: E2ECluster) -> tuple[str, str]:
    async def create() -> tuple[str, str]:
        client = connect(e2e.redis_url)
        try:
            token, secret = await AdminTokens(client).create("e2e")
            return token.id, secret
        finally:
            await client.aclose()

    return asyncio.run(create())


def test_operators_manage_tenants_over_the_admin_port(e2e: E2ECluster) -> None:
    token_id, secret = _admin_token(e2e)
    auth = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=e2e.admin_url, timeout=60) as admin:
        demo = admin.get("/admin/v1/tenants", headers={"Authorization": f"Bearer {e2e.demo_key}"})
        assert demo.status_code == 401
        origin = e2e.base_url.removesuffix("/v1")
        assert httpx.get(f"{origin}/admin/v1/tenants", headers=auth).status_code == 404
        assert admin.post("/admin/v1/tenants", headers=auth,
                          json={"id": "ops-made", "rpm": 30}).status_code == 201
        key = admin.post("/admin/v1/tenants/ops-made/keys", headers=auth,
                         json={"label": "e2e"}).json()["key"]
        client = e2e.client(key)
        reply = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens > 0

        assert admin.post("/admin/v1/tenants/ops-made/disable", headers=auth).status_code == 200
        with pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                {"role": "user", "content": "Hi"}])

        audit = admin.get("/admin/v1/audit", headers=auth).json()["data"]
        mine = [(e["action"], e["target"]) for e in audit if e["actor"] == f"admin:{token_id}"]
        assert mine == [("tenant.create", "ops-made"), ("key.create", "ops-made"),
                        ("tenant.disable", "ops-made")]
        page = admin.get("/admin/v1/organization/usage/completions", headers=auth, params={
            "start_time": int(time.time()) - 7200, "project_ids": ["ops-made"],
            "group_by": ["project_id"]}).json()
        (result,) = [r for b in page["data"] for r in b["results"]]
        assert result["num_model_requests"] == 1
        assert result["output_tokens"] == reply.usage.completion_tokens
        assert result["input_tokens"] == reply.usage.prompt_tokens
