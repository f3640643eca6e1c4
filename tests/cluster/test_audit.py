"""The audit log (router/state/audit.py) against real Redis: the CLI's changes with its user as
the actor, before and after, never a secret; a tenants file's reconciliation with the file as
the actor; the count and age bounds; `fairserve audit`; OpenTelemetry log records."""

from __future__ import annotations

import asyncio
import json
import time

from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

from cluster.cli import main
from router.state import keys
from router.state.audit import AuditLog, cli_actor
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import load_tenants, load_tenants_file


def _entries(redis_url: str, capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["audit", "--redis-url", redis_url, "--since", "1h", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_clis_changes_are_recorded_with_before_and_after_and_no_secret(
        redis_url, capsys) -> None:
    base = ["tenants"]
    assert main([*base, "add", "acme", "--rpm", "60", "--redis-url", redis_url]) == 0
    assert main([*base, "set", "acme", "--tpm", "1000", "--redis-url", redis_url]) == 0
    assert main([*base, "set", "acme", "--disabled", "--redis-url", redis_url]) == 0
    capsys.readouterr()
    assert main([*base, "key-create", "acme", "--label", "ci", "--redis-url", redis_url]) == 0
    secret = capsys.readouterr().out.strip()
    entries = _entries(redis_url, capsys)
    key_id = entries[-1]["after"]["key_id"]
    assert main([*base, "key-revoke", "acme", key_id, "--redis-url", redis_url]) == 0
    entries = _entries(redis_url, capsys)
    assert [e["action"] for e in entries] == ["tenant.create", "tenant.update", "tenant.disable",
                                              "key.create", "key.revoke"]
    assert {e["actor"] for e in entries} == {cli_actor()} and entries[0]["target"] == "acme"
    assert entries[0]["before"] is None and entries[0]["after"]["rpm"] == 60
    assert (entries[1]["before"]["tpm"], entries[1]["after"]["tpm"]) == (None, 1000)
    assert (entries[2]["before"]["disabled"], entries[2]["after"]["disabled"]) == (False, True)
    assert entries[3]["after"]["label"] == "ci" and len(entries[3]["after"]["digest"]) == 12
    assert entries[4]["before"] == {"key_id": key_id}
    assert secret and secret not in json.dumps(entries)


def test_a_tenants_files_reconciliation_is_recorded_as_the_files(redis_url, tmp_path,
                                                                   capsys) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - id: one\n    rpm: 5\n  - id: two\n")

    async def load() -> None:
        client = connect(redis_url)
        try:
            await load_tenants(Scripts(client), load_tenants_file(path),
                               audit=AuditLog(client), actor=f"file:{path}")
        finally:
            await client.aclose()

    asyncio.run(load())
    path.write_text("tenants:\n  - id: one\n    rpm: 7\n")
    asyncio.run(load())
    asyncio.run(load())  # unchanged: nothing recorded
    entries = _entries(redis_url, capsys)
    assert [(e["action"], e["target"]) for e in entries] == [
        ("tenant.create", "one"), ("tenant.create", "two"), ("tenant.update", "one"),
        ("tenant.disable", "two")]
    assert {e["actor"] for e in entries} == {f"file:{path}"}
    assert (entries[2]["before"]["rpm"], entries[2]["after"]["rpm"]) == (5, 7)


def test_the_log_keeps_its_bounds_and_goes_out_as_log_records(redis_url) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        exporter = InMemoryLogRecordExporter()
        try:
            old_ms = int(time.time() * 1000) - 3 * 86_400_000
            await client.xadd(keys.audit(), {"actor": "x", "action": "old", "target": "t",
                                             "before": "null", "after": "null"},
                              id=f"{old_ms}-0")
            log = AuditLog(client, retention_days=2, max_entries=5, env={},
                           log_exporter=exporter)
            for i in range(8):
                await log.record("cli:test", "tenant.update", f"t{i}", {"n": i}, {"n": i + 1})
            entries = await log.read()
            assert [e.target for e in entries] == ["t3", "t4", "t5", "t6", "t7"]  # count bound
            assert all(e.action != "old" for e in entries)  # the age bound
            log._otel.flush()
            records = [r.log_record for r in exporter.get_finished_logs()]
            assert len(records) == 8 and records[0].body == "cli:test tenant.update t0"
            assert records[-1].attributes["fairserve.audit.after"] == '{"n": 8}'
        finally:
            await client.aclose()

    asyncio.run(scenario())
