"""The admin API (router/admin/app.py) in-process over ASGI against real Redis: only admin
tokens are let in (a tenant key, none, or a revoked token is a 401); tenants are created,
read, changed and disabled; keys are created (shown once), listed by digest prefix and revoked,
and a created key authenticates; usage comes in OpenAI's usage shape; every change is in the
audit log under the token; bad input is a 400 naming the field; the document lists the routes."""

from __future__ import annotations

import asyncio
import time

import httpx

from router.admin.app import admin_app
from router.dispatch.response_events import end_data
from router.state.admin_tokens import AdminTokens
from router.state.api_keys import ApiKeys
from router.state.audit import AuditLog
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from tests.router.factories import make_request


async def _scenario(url: str) -> None:
    client = connect(url)
    scripts = Scripts(client)
    app = admin_app(scripts, AuditLog(client, env={}))
    token, secret = await AdminTokens(client).create("ops")
    auth = {"Authorization": f"Bearer {secret}"}
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
            assert (await http.get("/admin/v1/tenants")).status_code == 401
            made = await http.post("/admin/v1/tenants", headers=auth,
                                   json={"id": "acme", "rpm": 60})
            assert made.status_code == 201 and made.json()["rpm"] == 60
            key = (await http.post("/admin/v1/tenants/acme/keys", headers=auth,
                                   json={"label": "app"})).json()
            assert key["key"].startswith("fs-")
            tenant_key = {"Authorization": f"Bearer {key['key']}"}
            refused = await http.get("/admin/v1/tenants", headers=tenant_key)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == \
                "invalid_api_key"
            principal = await ApiKeys(scripts).authenticate(key["key"])
            assert principal.tenant_id == "acme"

            listed = (await http.get("/admin/v1/tenants/acme/keys", headers=auth,
                                     params={"digest_prefix": key["digest_prefix"][:6]})).json()
            assert [k["key_id"] for k in listed["data"]] == [key["key_id"]]
            assert not (await http.get("/admin/v1/tenants/acme/keys", headers=auth,
                                       params={"digest_prefix": "zz"})).json()["data"]
            changed = await http.patch("/admin/v1/tenants/acme", headers=auth, json={"tpm": 500})
            assert changed.json()["tpm"] == 500 and changed.json()["rpm"] == 60
            bad = await http.patch("/admin/v1/tenants/acme", headers=auth, json={"rpm": -1})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
            unknown = await http.patch("/admin/v1/tenants/acme", headers=auth, json={"x": 1})
            assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "x"
            assert (await http.get("/admin/v1/tenants/nobody", headers=auth)).status_code == 404
            assert (await http.post("/admin/v1/tenants", headers=auth,
                                    json={"id": "acme"})).status_code == 409
            disabled = await http.post("/admin/v1/tenants/acme/disable", headers=auth)
            assert disabled.json()["disabled"] is True
            gone = await http.delete(f"/admin/v1/tenants/acme/keys/{key['key_id']}",
                                     headers=auth)
            assert gone.status_code == 200

            # usage, in OpenAI's shape (the tenant is the project)
            await http.patch("/admin/v1/tenants/acme", headers=auth, json={"disabled": False})
            queues = TenantQueues(scripts)
            await queues.admit(make_request("acme", "r1", prompt_tokens=10, max_tokens=5,
                                            model="m"))
            (grant,) = (await queues.grant("d", 1)).grants
            await queues.complete(grant.lease, 10, 5, "stop", end_data("stop", 10, 5, 3))
            now_s = int(time.time())
            page = (await http.get("/admin/v1/organization/usage/completions", headers=auth,
                                   params={"start_time": now_s - 7200, "bucket_width": "1h",
                                           "group_by": ["project_id", "model"]})).json()
            assert page["object"] == "page" and page["has_more"] is False
            (result,) = [r for b in page["data"] for r in b["results"]]
            assert (result["project_id"], result["model"], result["input_tokens"],
                    result["output_tokens"], result["input_cached_tokens"],
                    result["num_model_requests"]) == ("acme", "m", 10, 5, 3, 1)
            backwards = await http.get("/admin/v1/organization/usage/completions",
                                       headers=auth, params={"start_time": now_s,
                                                             "end_time": now_s - 60})
            assert backwards.status_code == 400
            assert backwards.json()["error"]["param"] == "end_time"
            bucket = page["data"][0]
            assert bucket["end_time"] - bucket["start_time"] == 3600

            audit = (await http.get("/admin/v1/audit", headers=auth)).json()["data"]
            actions = [(e["actor"], e["action"]) for e in audit]
            assert actions[0] == (f"admin:{token.id}", "tenant.create")
            assert [a for _, a in actions] == ["tenant.create", "key.create", "tenant.update",
                                               "tenant.disable", "key.revoke", "tenant.enable"]
            assert key["key"] not in str(audit)

            document = (await http.get("/admin/openapi.json")).json()
            assert "/admin/v1/organization/usage/completions" in document["paths"]
            await AdminTokens(client).revoke(token.id)
            assert (await http.get("/admin/v1/tenants", headers=auth)).status_code == 401
    finally:
        await client.aclose()


def test_the_admin_api_manages_tenants_keys_usage_and_audit(redis_url) -> None:
    asyncio.run(_scenario(redis_url))


def test_a_tokens_file_is_reconciled_and_leaves_the_clis_tokens_alone(redis_url,
                                                                       tmp_path) -> None:
    import pytest
    import yaml

    from router.errors import InvalidRequestError
    from router.state.admin_tokens import new_token
    from router.state.api_keys import digest

    async def scenario() -> None:
        client = connect(redis_url)
        tokens = AdminTokens(client)
        try:
            _, cli_secret = await tokens.create("cli")
            made = [new_token() for _ in range(2)]
            entries = [{"id": i, "label": f"t{n}", "sha256": digest(s)}
                       for n, (i, s) in enumerate(made)]
            path = tmp_path / "admin-tokens.yaml"
            path.write_text(yaml.safe_dump({"admin_tokens": entries}))
            assert await tokens.load_file(path) == ([made[0][0], made[1][0]], [])
            assert await tokens.load_file(path) == ([], [])  # nothing changed
            assert (await tokens.verify(made[1][1])).label == "t1"
            path.write_text(yaml.safe_dump({"admin_tokens": entries[:1]}))
            assert await tokens.load_file(path) == ([], [made[1][0]])
            assert await tokens.verify(made[1][1]) is None
            assert await tokens.verify(made[0][1]) is not None
            assert await tokens.verify(cli_secret) is not None  # not the file's
            path.write_text(yaml.safe_dump({"admin_tokens": [{"id": "x", "sha256": "y"}]}))
            with pytest.raises(InvalidRequestError) as err:
                await tokens.load_file(path)
            assert err.value.param == "admin_tokens.0.id"
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_concurrent_creators_never_pass_the_token_cap(redis_url) -> None:
    """The count and the insert are one transaction: 20 creators at once, 5 below the cap,
    make exactly 5 tokens and 15 conflicts (each on its own connection)."""
    from router.errors import ConflictError
    from router.state.admin_tokens import MAX_ADMIN_TOKENS

    async def scenario() -> None:
        clients = [connect(redis_url) for _ in range(20)]
        try:
            for _ in range(MAX_ADMIN_TOKENS - 5):
                await AdminTokens(clients[0]).create("filler")
            results = await asyncio.gather(*(AdminTokens(c).create(f"c{i}")
                                             for i, c in enumerate(clients)),
                                           return_exceptions=True)
            made = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, ConflictError)]
            assert (len(made), len(refused)) == (5, 15), results
            assert len(await AdminTokens(clients[0]).list()) == MAX_ADMIN_TOKENS
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(scenario())
