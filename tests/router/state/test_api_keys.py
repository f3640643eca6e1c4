"""API keys: created and shown once, stored only as SHA-256 digests, refused at once when
revoked, and refused with the right status (401 or 403) without leaking other tenants."""

from __future__ import annotations

import hashlib
import re

import pytest

from router.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    StoredDataError,
)
from router.state.api_keys import Principal
from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, run


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def every_stored_byte_string(redis_client) -> list[bytes]:
    """Every key name, and every member, field and value of every key in the db."""
    found: list[bytes] = []
    for key in redis_client.scan_iter(count=1000):
        found.append(key)
        kind = redis_client.type(key)
        if kind == b"string":
            found.append(redis_client.get(key))
        elif kind == b"hash":
            for field, value in redis_client.hgetall(key).items():
                found += [field, value]
        elif kind == b"set":
            found += list(redis_client.smembers(key))
        elif kind == b"zset":
            found += redis_client.zrange(key, 0, -1)
        elif kind == b"list":
            found += redis_client.lrange(key, 0, -1)
        elif kind == b"stream":
            for _, entry in redis_client.xrange(key):
                for field, value in entry.items():
                    found += [field, value]
        else:
            raise AssertionError(f"unexpected key type {kind!r} of {key!r}")
    return found


def test_create_returns_a_key_that_authenticates_as_its_tenant(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            created = await h.api_keys.create("acme", label="ci")
            assert created.tenant_id == "acme"
            assert re.fullmatch(r"[0-9a-f]{8}", created.key_id)
            assert created.secret.startswith(f"fs-{created.key_id}-")
            principal = Principal("acme", created.key_id)
            assert await h.api_keys.authenticate(created.secret) == principal
            assert await h.api_keys.authenticate(created.secret, tenant_id="acme") == principal
            other = await h.api_keys.create("acme")
            assert other.secret != created.secret and other.key_id != created.key_id

    run(scenario())


def test_redis_holds_the_digest_and_never_the_secret(redis_url, redis_client) -> None:
    async def scenario() -> str:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            created = await h.api_keys.create("acme", label="ci")
            await h.api_keys.authenticate(created.secret)  # a lookup writes nothing either
            return created.secret

    secret = run(scenario())
    random_part = secret.rsplit("-", 1)[1].encode()
    stored = every_stored_byte_string(redis_client)
    assert len(stored) > 5
    assert not any(secret.encode() in s or random_part in s for s in stored)
    digest = sha256_hex(secret).encode()
    assert f"fs:apikey:{digest.decode()}".encode() in stored
    assert digest in redis_client.hvals("fs:{acme}:keys")


def test_a_revoked_key_is_refused_at_once(redis_url, redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            kept = await h.api_keys.create("acme")
            revoked = await h.api_keys.create("acme")
            await h.api_keys.authenticate(revoked.secret)
            await h.api_keys.revoke("acme", revoked.key_id)
            with pytest.raises(AuthenticationError) as err:
                await h.api_keys.authenticate(revoked.secret)
            assert err.value.status == 401
            assert not redis_client.exists(f"fs:apikey:{sha256_hex(revoked.secret)}")
            assert await h.api_keys.list("acme") == [kept.key_id]
            assert (await h.api_keys.authenticate(kept.secret)).key_id == kept.key_id

    run(scenario())


@pytest.mark.parametrize(
    "api_key",
    [
        None,
        "",
        "garbage",
        "Bearer fs-",
        "fs-deadbeef-" + "A" * 43,  # well formed, never issued
        "fs-" + "x" * 5000,  # very long: refused before any lookup
        "fs-deadbeef-ünïcødé",
    ],
)
def test_missing_or_unknown_keys_are_401(redis_url, api_key) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.api_keys.create("acme")
            await h.api_keys.authenticate(api_key)

    with pytest.raises(AuthenticationError) as err:
        run(scenario())
    assert err.value.status == 401 and err.value.code == "invalid_api_key"


def test_a_key_of_another_tenant_is_403_and_tells_nothing_about_it(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="alpha"), Tenant(id="beta", rpm=4242, tpm=31337))
            alpha_key = await h.api_keys.create("alpha")
            beta_key = await h.api_keys.create("beta")
            with pytest.raises(PermissionDeniedError) as err:
                await h.api_keys.authenticate(alpha_key.secret, tenant_id="beta")
            assert err.value.status == 403
            for secret_of_beta in ("4242", "31337", beta_key.key_id, beta_key.secret):
                assert secret_of_beta not in err.value.message
            # a claimed tenant that does not exist is refused the same way: no existence oracle
            with pytest.raises(PermissionDeniedError) as unknown:
                await h.api_keys.authenticate(alpha_key.secret, tenant_id="ghost")
            assert unknown.value.message == err.value.message

    run(scenario())


def test_a_disabled_tenants_keys_are_403_until_it_is_enabled(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            created = await h.api_keys.create("acme")
            await h.tenants.update("acme", disabled=True)
            with pytest.raises(PermissionDeniedError) as err:
                await h.api_keys.authenticate(created.secret)
            assert err.value.status == 403 and "disabled" in err.value.message
            await h.tenants.update("acme", disabled=False)  # no cache: applies at once
            assert (await h.api_keys.authenticate(created.secret)).tenant_id == "acme"

    run(scenario())


def test_create_for_an_unknown_tenant_is_not_found(redis_url, redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            with pytest.raises(NotFoundError) as err:
                await h.api_keys.create("ghost")
            assert err.value.status == 404 and "ghost" in err.value.message
            with pytest.raises(InvalidRequestError):
                await h.api_keys.create("Gh{o}st")

    run(scenario())
    assert redis_client.dbsize() == 0


def test_revoke_of_an_unknown_key_id_is_not_found(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="alpha"), Tenant(id="beta"))
            beta_key = await h.api_keys.create("beta")
            with pytest.raises(NotFoundError):
                await h.api_keys.revoke("alpha", "0123abcd")
            with pytest.raises(NotFoundError):  # another tenant's key id is not alpha's
                await h.api_keys.revoke("alpha", beta_key.key_id)
            assert (await h.api_keys.authenticate(beta_key.secret)).tenant_id == "beta"

    run(scenario())


def test_list_shows_key_ids_only(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"), Tenant(id="beta"))
            assert await h.api_keys.list("acme") == []
            created = [await h.api_keys.create("acme") for _ in range(3)]
            await h.api_keys.create("beta")
            listed = await h.api_keys.list("acme")
            assert listed == sorted(c.key_id for c in created)
            assert not any(c.secret in listed or sha256_hex(c.secret) in listed for c in created)

    run(scenario())


@pytest.mark.parametrize(("field", "value"), [("tenant", "BAD{x}"), ("tenant", None),
                                              ("key_id", None)])
def test_a_malformed_key_record_is_stored_data_error(redis_url, redis_client, field,
                                                     value) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            created = await h.api_keys.create("acme")
            record = f"fs:apikey:{sha256_hex(created.secret)}"
            if value is None:
                redis_client.hdel(record, field)
            else:
                redis_client.hset(record, field, value)
            with pytest.raises(StoredDataError) as err:
                await h.api_keys.authenticate(created.secret)
            assert record in err.value.message and err.value.status == 500

    run(scenario())


def test_a_tenant_past_its_quotas_is_refused_before_any_work(redis_url) -> None:
    """Authentication for a submission reads the tenant's limiters in its one round trip and
    refuses what no token count could let through (rpm full, tpm full for even one token, the
    day's budget used), with the admission's reason and Retry-After; it consumes nothing, and a
    plain authentication (a GET) is never refused for quotas."""
    from router.errors import RateLimitError
    from tests.router.factories import make_request

    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="rpm", rpm=2), Tenant(id="tpm", tpm=6),
                              Tenant(id="day", daily_tokens=60), Tenant(id="free"))
            secrets = {t: (await h.api_keys.create(t)).secret for t in ("rpm", "tpm", "day",
                                                                         "free")}
            for t in ("rpm", "tpm", "day", "free"):  # under the limits: let through
                await h.api_keys.authenticate(secrets[t], for_admission=True)
            for i in range(2):
                await h.queues.admit(make_request("rpm", f"r{i}", prompt_tokens=1, max_tokens=1))
            await h.queues.admit(make_request("tpm", "t0", prompt_tokens=3, max_tokens=3))
            await h.queues.admit(make_request("day", "d0", prompt_tokens=30, max_tokens=30))
            for t, reason, most_s in (("rpm", "rpm", 30), ("tpm", "tpm", 10),
                                      ("day", "daily_budget", 86_400)):
                with pytest.raises(RateLimitError) as err:
                    await h.api_keys.authenticate(secrets[t], for_admission=True)
                assert err.value.status == 429 and err.value.reason == reason, t
                assert 0 < err.value.retry_after_s <= most_s, (t, err.value.retry_after_s)
                assert (await h.api_keys.authenticate(secrets[t])).tenant_id == t  # a GET
            await h.api_keys.authenticate(secrets["free"], for_admission=True)
            # nothing was consumed: the admission still says the same, with its own reason
            with pytest.raises(RateLimitError) as err:
                await h.queues.admit(make_request("rpm", "r2", prompt_tokens=1, max_tokens=1))
            assert err.value.reason == "rpm"

    run(scenario())
