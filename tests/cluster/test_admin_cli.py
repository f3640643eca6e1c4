"""The CLI over the admin API (``--admin-url``, cluster/admin_client.py): the admin app served
by uvicorn on a socket (a real HTTP server) against real Redis; tenants, keys, usage and audit
commands through it, changes audited under the token; admin tokens made, listed and revoked
with the CLI; a missing or revoked token, or a command that needs Redis, is an error line."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from cluster.cli import main
from router.admin.app import admin_app
from router.state.audit import AuditLog
from router.state.redis_client import connect
from router.state.scripts import Scripts


@pytest.fixture
def admin_url(redis_url: str) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    client = connect(redis_url)
    app = admin_app(Scripts(client), AuditLog(client, env={}))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _token(redis_url: str, capsys) -> str:
    capsys.readouterr()
    assert main(["admin", "token-create", "--label", "ops", "--redis-url", redis_url]) == 0
    return capsys.readouterr().out.strip()


def test_tenants_keys_usage_and_audit_over_the_admin_api(redis_url, admin_url, capsys,
                                                         monkeypatch, tmp_path) -> None:
    token = _token(redis_url, capsys)
    monkeypatch.setenv("FAIRSERVE_ADMIN_TOKEN", token)
    over = ["--admin-url", admin_url]
    assert main(["tenants", "add", "acme", "--rpm", "60", *over]) == 0
    assert main(["tenants", "set", "acme", "--tpm", "900", *over]) == 0
    capsys.readouterr()
    assert main(["tenants", "list", "--json", *over]) == 0
    out = capsys.readouterr()
    (acme,) = json.loads(out.out)
    assert (acme["id"], acme["rpm"], acme["tpm"], acme["num_keys"]) == ("acme", 60, 900, 0)
    assert main(["tenants", "key-create", "acme", *over]) == 0
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("fs-")
    key_id = secret.split("-")[1]
    assert main(["tenants", "key-revoke", "acme", key_id, *over]) == 0
    capsys.readouterr()
    assert main(["usage", "--since", "1h", "--format", "json", *over]) == 0
    assert json.loads(capsys.readouterr().out) == []  # no requests yet
    capsys.readouterr()
    assert main(["audit", "--since", "1h", "--format", "json", *over]) == 0
    entries = json.loads(capsys.readouterr().out)
    admin_entries = [e for e in entries if e["actor"].startswith("admin:")]
    assert [e["action"] for e in admin_entries] == ["tenant.create", "tenant.update",
                                                    "key.create", "key.revoke"]
    assert secret not in json.dumps(entries)

    path = tmp_path / "t.yaml"
    path.write_text("tenants:\n  - id: x\n")
    assert main(["tenants", "load", str(path), *over]) == 1
    assert "--redis-url" in capsys.readouterr().err

    capsys.readouterr()
    assert main(["admin", "token-list", "--redis-url", redis_url]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    token_id = line.split()[0]
    assert line.endswith("ops") and token.startswith(f"fsa-{token_id}-")
    assert main(["admin", "token-revoke", token_id, "--redis-url", redis_url]) == 0
    capsys.readouterr()
    assert main(["tenants", "list", *over]) == 1
    assert "401" in capsys.readouterr().err
    monkeypatch.delenv("FAIRSERVE_ADMIN_TOKEN")
    assert main(["tenants", "list", *over]) == 1
    assert "FAIRSERVE_ADMIN_TOKEN" in capsys.readouterr().err
