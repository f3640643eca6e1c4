"""``fairserve tenants``: every subcommand in-process against the session's real Redis, the YAML
load, clearing limits, keys that authenticate and then stop, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.ports import free_port
from router.errors import AuthenticationError
from router.state.api_keys import Principal
from router.state.redis_client import with_password
from router.state.tenants import Tenant
from tests.router.factories import harness, run


def tenants(url: str, *argv: str) -> int:
    return main(["tenants", *argv, "--redis-url", url])


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # no traceback, no noise
    assert lines[0].startswith("error: ")
    return lines[0]


def stored(url: str, tenant_id: str) -> Tenant:
    async def get() -> Tenant:
        async with harness(url) as h:
            return await h.tenants.get(tenant_id)

    return run(get())


def authenticate(url: str, api_key: str) -> Principal:
    async def auth() -> Principal:
        async with harness(url) as h:
            return await h.api_keys.authenticate(api_key)

    return run(auth())


def test_add_stores_the_options_and_defaults_the_rest(redis_url, capsys) -> None:
    assert tenants(redis_url, "add", "acme", "--weight", "2.5", "--priority", "3", "--rpm", "600",
                   "--tpm", "90000", "--daily-tokens", "1000000", "--max-tokens", "512",
                   "--max-queued", "40", "--disabled") == 0
    assert "added tenant acme" in capsys.readouterr().out
    assert stored(redis_url, "acme") == Tenant(
        id="acme", weight=2.5, priority=3, rpm=600, tpm=90000, daily_tokens=1_000_000,
        max_tokens=512, max_queued=40, disabled=True)
    assert tenants(redis_url, "add", "beta") == 0
    assert stored(redis_url, "beta") == Tenant(id="beta")


def test_add_refuses_an_existing_id_and_keeps_its_settings(redis_url, capsys) -> None:
    assert tenants(redis_url, "add", "acme", "--rpm", "5") == 0
    capsys.readouterr()
    assert tenants(redis_url, "add", "acme", "--rpm", "999") == 1
    assert "tenant 'acme' exists" in one_error_line(capsys)
    assert stored(redis_url, "acme").rpm == 5


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["add", "A{b}"], "invalid tenant id 'A{b}'"),
        (["add", "x:y"], "invalid tenant id 'x:y'"),
        (["add", "acme", "--weight", "0"], "weight"),
        (["add", "acme", "--priority", "10"], "priority"),
        (["add", "acme", "--rpm", "0"], "rpm"),
    ],
)
def test_add_with_bad_values_names_the_field_and_writes_nothing(
    redis_url, redis_client, capsys, argv, named
) -> None:
    assert tenants(redis_url, *argv) == 1
    assert named in one_error_line(capsys)
    assert redis_client.dbsize() == 0


def test_usage_errors_exit_2_as_argparse_does(redis_url, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        tenants(redis_url, "add", "acme", "--rpm", "lots")
    assert exit_.value.code == 2
    assert "expected an integer or 'none'" in capsys.readouterr().err


def test_list_shows_a_table_with_unlimited_as_dash_and_key_counts(redis_url, capsys) -> None:
    assert tenants(redis_url, "list") == 0
    assert "no tenants" in capsys.readouterr().out
    tenants(redis_url, "add", "beta", "--rpm", "60", "--disabled")
    tenants(redis_url, "add", "acme", "--weight", "2", "--tpm", "5000",
            "--models", "SmolLM2-135M-Instruct,acme/support")
    tenants(redis_url, "key-create", "acme")
    tenants(redis_url, "key-create", "acme")
    capsys.readouterr()
    assert tenants(redis_url, "list") == 0
    header, *rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()]
    assert header == ["id", "weight", "priority", "rpm", "tpm", "daily_tokens", "max_tokens",
                      "max_queued", "max_streams", "max_resumes", "cache_group", "models",
                      "disabled", "keys"]
    assert rows == [
        ["acme", "2", "0", "-", "5000", "-", "4096", "1000", "512", "64", "-",
         "SmolLM2-135M-Instruct,acme/support", "no", "2"],
        ["beta", "1", "0", "60", "-", "-", "4096", "1000", "512", "64", "-", "-", "yes", "0"],
    ]
    assert stored(redis_url, "acme").models == ["SmolLM2-135M-Instruct", "acme/support"]
    assert tenants(redis_url, "set", "acme", "--models", "none") == 0
    assert stored(redis_url, "acme").models is None


def test_list_json_is_a_list_of_settings_with_key_counts(redis_url, capsys) -> None:
    tenants(redis_url, "add", "acme", "--rpm", "60")
    tenants(redis_url, "key-create", "acme")
    capsys.readouterr()
    assert tenants(redis_url, "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == [{
        "id": "acme", "weight": 1.0, "priority": 0, "rpm": 60, "tpm": None, "daily_tokens": None,
        "max_tokens": 4096, "max_queued": 1000, "max_streams": 512, "max_resumes": 64,
        "cache_group": None, "models": None, "disabled": False, "num_keys": 1,
    }]


def test_set_changes_only_what_it_is_given_and_none_clears_a_limit(redis_url, redis_client,
                                                                    capsys) -> None:
    tenants(redis_url, "add", "acme", "--weight", "3", "--rpm", "60", "--tpm", "5000",
            "--daily-tokens", "100000")
    assert tenants(redis_url, "set", "acme", "--rpm", "none", "--daily-tokens", "None",
                   "--priority", "2") == 0
    assert "rpm=-" in capsys.readouterr().out
    assert stored(redis_url, "acme") == Tenant(id="acme", weight=3, priority=2, tpm=5000)
    assert not redis_client.hexists("fs:{acme}:tenant", "rpm")  # absent: unlimited
    assert tenants(redis_url, "set", "acme", "--disabled") == 0
    assert stored(redis_url, "acme").disabled
    assert tenants(redis_url, "set", "acme", "--enabled") == 0
    assert not stored(redis_url, "acme").disabled


def test_set_refuses_unknown_tenants_bad_values_and_nothing_to_set(redis_url, capsys) -> None:
    assert tenants(redis_url, "set", "ghost", "--rpm", "5") == 1
    assert "unknown tenant 'ghost'" in one_error_line(capsys)
    tenants(redis_url, "add", "acme", "--max-tokens", "100")
    capsys.readouterr()
    assert tenants(redis_url, "set", "acme", "--max-tokens", "0") == 1
    assert "max_tokens" in one_error_line(capsys)
    assert tenants(redis_url, "set", "acme") == 1
    assert "nothing to set" in one_error_line(capsys)
    assert stored(redis_url, "acme").max_tokens == 100
    with pytest.raises(SystemExit) as exit_:  # both switches at once is a usage error
        tenants(redis_url, "set", "acme", "--enabled", "--disabled")
    assert exit_.value.code == 2


def test_key_create_prints_a_key_that_authenticates(redis_url, redis_client, capsys) -> None:
    tenants(redis_url, "add", "acme")
    capsys.readouterr()
    assert tenants(redis_url, "key-create", "acme", "--label", "ci") == 0
    captured = capsys.readouterr()
    api_key = captured.out.strip()  # the key alone on stdout
    assert api_key.startswith("fs-") and "\n" not in api_key
    assert "cannot be shown again" in captured.err
    principal = authenticate(redis_url, api_key)
    assert principal.tenant_id == "acme" and principal.key_id in captured.err
    digest = redis_client.hget("fs:{acme}:keys", principal.key_id).decode()
    assert redis_client.hget(f"fs:apikey:{digest}", "label") == b"ci"


def test_key_revoke_refuses_the_key_at_once(redis_url, capsys) -> None:
    tenants(redis_url, "add", "acme")
    capsys.readouterr()
    tenants(redis_url, "key-create", "acme")
    api_key = capsys.readouterr().out.strip()
    key_id = authenticate(redis_url, api_key).key_id
    assert tenants(redis_url, "key-revoke", "acme", key_id) == 0
    assert f"revoked key {key_id}" in capsys.readouterr().out
    with pytest.raises(AuthenticationError):
        authenticate(redis_url, api_key)
    assert tenants(redis_url, "key-revoke", "acme", key_id) == 1  # already gone
    assert f"no key '{key_id}'" in one_error_line(capsys)


def test_key_commands_on_an_unknown_tenant_say_so(redis_url, redis_client, capsys) -> None:
    assert tenants(redis_url, "key-create", "ghost") == 1
    assert "unknown tenant 'ghost'" in one_error_line(capsys)
    assert tenants(redis_url, "key-revoke", "ghost", "0123abcd") == 1
    assert "unknown tenant 'ghost'" in one_error_line(capsys)
    assert redis_client.dbsize() == 0


def test_load_creates_and_updates_from_yaml(redis_url, tmp_path: Path, capsys) -> None:
    tenants(redis_url, "add", "acme", "--rpm", "60")
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n"
                    "  - id: acme\n    weight: 2\n    priority: 1\n"
                    "  - id: beta\n    tpm: 200000\n    max_queued: 5\n")
    capsys.readouterr()
    assert tenants(redis_url, "load", str(path)) == 0
    assert "1 created, 1 updated" in capsys.readouterr().out
    # a file entry is the whole tenant: what it leaves out is the default (rpm cleared)
    assert stored(redis_url, "acme") == Tenant(id="acme", weight=2, priority=1)
    assert stored(redis_url, "beta") == Tenant(id="beta", tpm=200_000, max_queued=5)


def test_load_of_a_bad_file_names_the_entry_and_field_and_writes_nothing(
    redis_url, redis_client, tmp_path: Path, capsys
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tenants:\n  - id: good\n  - id: acme\n    weight: heavy\n")
    assert tenants(redis_url, "load", str(path)) == 1
    line = one_error_line(capsys)
    assert "tenants[1].weight" in line and str(path) in line
    assert redis_client.dbsize() == 0  # the good entry before it was not loaded either
    assert tenants(redis_url, "load", str(tmp_path / "missing.yaml")) == 1
    assert "cannot read" in one_error_line(capsys)


def test_redis_url_defaults_to_the_environment(redis_url, monkeypatch, capsys) -> None:
    monkeypatch.delenv("FAIRSERVE_REDIS__URL", raising=False)
    monkeypatch.setenv("FAIRSERVE_REDIS_URL", redis_url)
    assert main(["tenants", "add", "acme"]) == 0
    assert stored(redis_url, "acme") == Tenant(id="acme")


def test_redis_url_defaults_to_the_running_fairserve_up_and_takes_a_password_file(
        redis_client, redis_url, tmp_path, monkeypatch, capsys) -> None:
    for name in ("FAIRSERVE_REDIS__URL", "FAIRSERVE_REDIS_URL", "FAIRSERVE_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".fairserve").mkdir()
    (tmp_path / ".fairserve" / "run.json").write_text(json.dumps({"redis_url": redis_url}))
    redis_client.config_set("requirepass", "s3cret")
    try:
        (tmp_path / "password").write_text("s3cret\n")  # as a Ray pod has it mounted
        monkeypatch.setenv("FAIRSERVE_REDIS__PASSWORD_FILE", str(tmp_path / "password"))
        assert main(["tenants", "add", "acme"]) == 0  # no --redis-url: the running cluster's
        assert stored(with_password(redis_url, "s3cret"), "acme") == Tenant(id="acme")
    finally:
        redis_client.config_set("requirepass", "")  # this connection authenticated before


def test_unreachable_redis_is_one_clear_line(capsys) -> None:
    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    assert tenants(url, "list") == 1
    line = one_error_line(capsys)
    assert "cannot reach Redis at redis://user:***@127.0.0.1" in line
    assert "hunter2" not in line
    assert tenants("http://nowhere", "list") == 1
    assert "invalid --redis-url" in one_error_line(capsys)


def test_the_tenants_cli_does_not_import_torch() -> None:
    code = ("import sys; from cluster.cli import main; import cluster.tenants_cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_key_new_stores_nothing_and_its_entry_loads_a_working_key(redis_url, redis_client,
                                                                  tmp_path, capsys) -> None:
    assert main(["tenants", "key-new", "acme", "--label", "k8s"]) == 0
    captured = capsys.readouterr()
    secret = captured.out.strip()
    entry = captured.err[captured.err.index("tenants:"):]
    assert redis_client.dbsize() == 0  # made here, stored nowhere
    assert secret not in entry  # the file holds the digest only
    path = tmp_path / "tenants.yaml"
    path.write_text(entry)
    assert tenants(redis_url, "load", str(path)) == 0
    assert "1 API keys added" in capsys.readouterr().out
    assert authenticate(redis_url, secret).tenant_id == "acme"
    assert main(["tenants", "key-new", "Not A Tenant"]) == 1
    assert "id" in one_error_line(capsys)


def test_a_cache_group_is_set_shown_and_cleared(redis_url, capsys) -> None:
    tenants(redis_url, "add", "acme")
    assert tenants(redis_url, "set", "acme", "--cache-group", "partners") == 0
    assert stored(redis_url, "acme").cache_group == "partners"
    assert tenants(redis_url, "set", "acme", "--cache-group", "none") == 0
    assert stored(redis_url, "acme").cache_group is None
    capsys.readouterr()
    assert tenants(redis_url, "set", "acme", "--cache-group", "Bad Name") != 0
    assert "cache_group" in capsys.readouterr().err
