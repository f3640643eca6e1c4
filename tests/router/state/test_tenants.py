"""Tenants: the store's round trip, defaults, validation, YAML files, malformed stored data, and
a priority change that moves a backlogged tenant to its new class."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from router.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    StoredDataError,
)
from router.state import keys
from router.state.api_keys import ApiKeys, digest, new_key
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import (
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_TOKENS,
    Tenant,
    TenantStore,
    load_tenants,
    load_tenants_file,
    parse_tenants_yaml,
)
from tests.router.factories import add_tenants, harness, make_request, run

FULL = Tenant(id="acme", weight=2.5, priority=3, rpm=60, tpm=1000, daily_tokens=10_000,
              max_tokens=512, max_queued=7, disabled=True)


def test_add_get_list_round_trip(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, FULL, Tenant(id="beta"), Tenant(id="a-1"))
            assert await h.tenants.get("acme") == FULL
            assert await h.tenants.get("beta") == Tenant(id="beta")
            assert [t.id for t in await h.tenants.all()] == ["a-1", "acme", "beta"]
            with pytest.raises(ConflictError):
                await h.tenants.add(Tenant(id="acme", weight=9))
            assert await h.tenants.get("acme") == FULL  # the refused add changed nothing
            with pytest.raises(NotFoundError):
                await h.tenants.get("ghost")

    run(scenario())


def test_update_changes_named_fields_and_none_clears_a_limit(redis_url, redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, FULL)
            changed = await h.tenants.update("acme", rpm=None, weight=4, disabled=False)
            assert changed == FULL.model_copy(update={"rpm": None, "weight": 4.0,
                                                       "disabled": False})
            assert await h.tenants.get("acme") == changed
            assert not redis_client.hexists("fs:{acme}:tenant", "rpm")
            with pytest.raises(NotFoundError):
                await h.tenants.update("ghost", rpm=5)
            with pytest.raises(InvalidRequestError) as err:
                await h.tenants.update("acme", weight=0)
            assert err.value.param == "weight"
            with pytest.raises(InvalidRequestError) as err:
                await h.tenants.update("acme", colour="red")
            assert err.value.param == "colour"
            assert await h.tenants.get("acme") == changed

    run(scenario())


def test_put_creates_or_replaces_the_whole_tenant(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            assert await h.tenants.put(FULL) is True
            assert await h.tenants.put(Tenant(id="acme", tpm=50)) is False
            # replaced, not merged: what the new settings leave out is back to the default
            assert await h.tenants.get("acme") == Tenant(id="acme", tpm=50)
            assert await h.tenants.load([Tenant(id="acme"), Tenant(id="beta")]) == (1, 1)

    run(scenario())


def test_defaults_are_unlimited_quotas_and_named_caps() -> None:
    tenant = Tenant(id="acme")
    assert (tenant.weight, tenant.priority, tenant.disabled) == (1.0, 0, False)
    assert (tenant.rpm, tenant.tpm, tenant.daily_tokens) == (None, None, None)
    assert (tenant.max_tokens, tenant.max_queued) == (DEFAULT_MAX_TOKENS, DEFAULT_MAX_QUEUED)
    assert set(tenant.to_redis()) == {"weight", "priority", "max_tokens", "max_queued",
                                      "max_streams", "max_resumes",
                                      "disabled"}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": -1}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"priority": 10}, "priority"),
        ({"priority": -1}, "priority"),
        ({"rpm": 0}, "rpm"),
        ({"tpm": 1.5}, "tpm"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_queued": 0}, "max_queued"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_out_of_range_settings_are_refused(fields, field) -> None:
    with pytest.raises(ValidationError) as err:
        Tenant(id="acme", **fields)
    assert [e["loc"] for e in err.value.errors()] == [(field,)]


@pytest.mark.parametrize("tenant_id", ["A{b}", "x:y", "a b", "", "-a", "a}", "x" * 64, "é"])
def test_ids_that_could_break_a_key_name_are_refused(redis_url, tenant_id) -> None:
    with pytest.raises(ValidationError) as err:
        Tenant(id=tenant_id)
    assert err.value.errors()[0]["loc"] == ("id",)

    async def lookup() -> None:
        async with harness(redis_url) as h:
            await h.tenants.get(tenant_id)

    with pytest.raises(InvalidRequestError) as refused:
        run(lookup())
    assert refused.value.param == "tenant"


def test_a_valid_yaml_file_gives_its_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - id: acme\n    weight: 2\n    rpm: 600\n  - id: beta\n")
    document = load_tenants_file(path)
    assert document.tenants == [Tenant(id="acme", weight=2, rpm=600), Tenant(id="beta")]
    assert document.api_keys == []
    assert parse_tenants_yaml("tenants: []").tenants == []


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("tenants: [", "not valid YAML"),
        ("- id: acme", "expected a mapping with a 'tenants' list"),
        ("tenants: {id: acme}", "expected a mapping with a 'tenants' list"),
        ("tenants:\n  - id: acme\n  - id: beta\n    weight: heavy\n", "tenants[1].weight"),
        ("tenants:\n  - id: acme\n    wieght: 2\n", "tenants[0].wieght"),
        ("tenants:\n  - weight: 2\n", "tenants[0].id"),
        ("tenants:\n  - id: Acme\n", "tenants[0].id"),
        ("tenants:\n  - acme\n", "tenants[0]"),
        ("tenants:\n  - id: acme\n  - id: beta\n    priority: 12\n", "tenants[1].priority"),
        ("tenants:\n  - id: acme\n    api_keys: [{id: 0123abcd, sha256: fs-0123abcd-secret}]\n",
         "tenants[0].api_keys[0].sha256: must be 64 lowercase hex digits"),
        ("tenants:\n  - id: acme\n    api_keys: [{id: key1, sha256: " + "a" * 64 + "}]\n",
         "tenants[0].api_keys[0].id"),
        ("tenants:\n  - id: acme\n    api_keys: {id: 0123abcd}\n", "tenants[0].api_keys"),
    ],
)
def test_yaml_errors_name_the_entry_and_field(text, named) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_tenants_yaml(text, source="t.yaml")
    assert named in err.value.message and err.value.message.startswith("t.yaml: ")


def test_duplicate_ids_in_a_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("tenants:\n  - id: acme\n  - id: beta\n  - id: acme\n    weight: 3\n")
    with pytest.raises(InvalidRequestError) as err:
        load_tenants_file(path)
    assert "duplicate tenant ids ['acme']" in err.value.message
    assert str(path) in err.value.message


@pytest.mark.parametrize(("field", "value"), [("weight", "abc"), ("priority", "12"),
                                              ("max_queued", "-3")])
def test_malformed_stored_settings_raise_stored_data_error(redis_url, redis_client, field,
                                                           value) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            redis_client.hset("fs:{acme}:tenant", field, value)
            with pytest.raises(StoredDataError) as err:
                await h.tenants.get("acme")
            assert "fs:{acme}:tenant" in err.value.message and field in err.value.message
            with pytest.raises(StoredDataError):
                await h.tenants.all()
            # admission refuses cleanly before writing anything
            with pytest.raises(StoredDataError) as err:
                await h.queues.admit(make_request("acme", "r1"))
            assert "fs:{acme}:tenant" in err.value.message and field in err.value.message
            assert await h.queues.depth("acme") == 0
            assert not redis_client.exists("fs:{acme}:req:r1")

    run(scenario())


def test_an_unknown_stored_field_is_malformed_data(redis_url, redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            redis_client.hset("fs:{acme}:tenant", "colour", "red")
            with pytest.raises(StoredDataError) as err:
                await h.tenants.get("acme")
            assert "colour" in err.value.message

    run(scenario())


def test_a_change_applies_to_the_next_admission(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r1"))
            await h.tenants.update("acme", disabled=True)
            with pytest.raises(PermissionDeniedError):
                await h.queues.admit(make_request("acme", "r2"))
            await h.tenants.update("acme", disabled=False)
            await h.queues.admit(make_request("acme", "r2"))
            assert await h.queues.queued_ids("acme") == ["r1", "r2"]

    run(scenario())


def test_priority_change_moves_a_backlogged_tenant_to_its_new_class(redis_url,
                                                                     redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="alpha"), Tenant(id="beta"))
            for tenant in ("alpha", "beta"):
                for i in range(2):
                    await h.queues.admit(make_request(tenant, f"{tenant}{i}"))
            # in class 0 together, alpha (same start tag, first by name) would go first
            await h.tenants.update("beta", priority=1)
            assert redis_client.zscore("fs:{sched}:ready:0", "beta") is None
            assert redis_client.zscore("fs:{sched}:ready:1", "beta") is not None
            await h.queues.admit(make_request("beta", "beta2"))  # new ones: the new class too
            batch = await h.queues.grant("d", 10)
            assert [g.request_id for g in batch.grants] == [
                "beta0", "beta1", "beta2", "alpha0", "alpha1"]
            assert batch.warnings == []

    run(scenario())


def test_priority_change_of_an_idle_tenant_leaves_the_classes_alone(redis_url,
                                                                     redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="alpha"), Tenant(id="beta"))
            await h.queues.admit(make_request("alpha", "a0"))
            await h.tenants.update("beta", priority=5)
            assert redis_client.zrange("fs:{sched}:classes", 0, -1) == [b"0"]
            assert [g.request_id for g in (await h.queues.grant("d", 10)).grants] == ["a0"]

    run(scenario())


def test_a_file_bootstraps_tenants_and_their_key_digests_idempotently(redis_url) -> None:
    key_id, secret = new_key()
    text = yaml.safe_dump({"tenants": [{"id": "acme", "weight": 2, "api_keys": [
        {"id": key_id, "sha256": digest(secret), "label": "ci"}]}, {"id": "beta"}]})
    document = parse_tenants_yaml(text)

    async def scenario() -> None:
        client = connect(redis_url)
        try:
            scripts = Scripts(client)
            first = await load_tenants(scripts, document)
            assert (first.num_created, first.num_updated, first.num_keys_added) == (2, 0, 1)
            again = await load_tenants(scripts, document)  # every deploy loads it again
            assert (again.num_created, again.num_updated, again.num_keys_added,
                    again.num_unchanged) == (0, 0, 0, 2)
            principal = await ApiKeys(scripts).authenticate(secret)
            assert (principal.tenant_id, principal.key_id) == ("acme", key_id)
            stored = await client.hgetall(keys.api_keys("acme"))
            assert secret.encode() not in b"".join([*stored.keys(), *stored.values()])
            # the same key id with another digest is a conflict, never an overwrite
            other = parse_tenants_yaml(text.replace(digest(secret), "f" * 64))
            with pytest.raises(ConflictError):
                await load_tenants(scripts, other)
            assert (await ApiKeys(scripts).authenticate(secret)).tenant_id == "acme"
        finally:
            await client.aclose()

    run(scenario())


def test_the_file_reconciles_its_tenants_and_leaves_cli_changes_and_others_alone(
        redis_url) -> None:
    """What a redeploy does with the tenants file (the chart's Secret): CLI changes stick until
    the file changes that field, keys the file drops are revoked, a tenant it drops is
    disabled, tenants it never listed are untouched."""
    k1, k2, k3 = new_key(), new_key(), new_key()

    def document(acme: dict, keys_: list, with_beta: bool = True):
        entries = [{"id": "acme", **acme, "api_keys": [
            {"id": key_id, "sha256": digest(secret)} for key_id, secret in keys_]}]
        if with_beta:
            entries.append({"id": "beta", "api_keys": [{"id": k3[0], "sha256": digest(k3[1])}]})
        return parse_tenants_yaml(yaml.safe_dump({"tenants": entries}))

    async def scenario() -> None:
        client = connect(redis_url)
        try:
            scripts = Scripts(client)
            store, api_keys = TenantStore(scripts), ApiKeys(scripts)
            first = await load_tenants(scripts, document({"weight": 2}, [k1, k2]))
            assert (first.num_created, first.num_keys_added) == (2, 3)
            await store.add(Tenant(id="cli-only", rpm=7))
            cli_key = await api_keys.create("acme")
            # operators' changes with the CLI
            await store.update("acme", disabled=True)
            await store.update("beta", rpm=5)
            again = await load_tenants(scripts, document({"weight": 2}, [k1, k2]))
            assert (again.num_unchanged, again.num_updated, again.num_keys_revoked) == (2, 0, 0)
            assert (await store.get("acme")).disabled and (await store.get("beta")).rpm == 5

            # a partial file loaded by hand without prune leaves beta alone
            partial = await load_tenants(scripts, document({"weight": 2}, [k1, k2],
                                                           with_beta=False), prune=False)
            assert partial.num_released == 0 and not (await store.get("beta")).disabled
            # the file changes acme's weight and drops k2 and beta
            third = await load_tenants(scripts, document({"weight": 3}, [k1], with_beta=False))
            assert (third.num_updated, third.num_keys_revoked, third.num_released) == (1, 2, 1)
            acme = await store.get("acme")
            assert acme.weight == 3 and acme.disabled  # the file's change, the CLI's kept
            assert sorted(await api_keys.list("acme")) == sorted([k1[0], cli_key.key_id])
            with pytest.raises(AuthenticationError):  # revoked: unknown, whoever asks
                await api_keys.authenticate(k2[1])
            assert (await store.get("beta")).disabled  # released: disabled, not deleted
            assert await api_keys.list("beta") == []
            assert await store.get("cli-only") == Tenant(id="cli-only", rpm=7)
            # the file lists k2 again: it is back
            await load_tenants(scripts, document({"weight": 3}, [k1, k2], with_beta=False))
            assert k2[0] in await api_keys.list("acme")
        finally:
            await client.aclose()

    run(scenario())
