"""The LoRA adapters a request may name as its ``model`` (router/state/adapters.py): the
settings' (every tenant's) and those added at run time, a tenant's own private to it; on a real
Redis."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.errors import InvalidRequestError, NotFoundError
from router.state import keys
from router.state.adapters import MAX_ADAPTERS, MODEL_NOT_FOUND, Adapter, AdapterRegistry
from router.state.redis_client import connect
from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, make_request, run

BASE = "SmolLM2-135M-Instruct"


def test_names_resolve_to_the_base_an_adapter_or_a_404_that_hides_anothers(redis_url) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        try:
            registry = AdapterRegistry(client, {BASE: ("tone",)})
            await registry.add(Adapter("acme-support", "/shared/acme", owner="acme"))
            await registry.add(Adapter("shared/legal", "/shared/legal"))
            assert await registry.resolve("acme", BASE) is None
            assert await registry.resolve("beta", "tone") == Adapter("tone", None, base=BASE)
            mine = await registry.resolve("acme", "acme-support")
            assert (mine.path, mine.owner, mine.base) == ("/shared/acme", "acme", BASE)
            assert (await registry.resolve("beta", "shared/legal")).path == "/shared/legal"
            for tenant, model in (("beta", "acme-support"), ("acme", "gpt-4o"),
                                  ("acme", "no such name!")):
                with pytest.raises(NotFoundError) as err:
                    await registry.resolve(tenant, model)
                assert (err.value.code, err.value.param) == (MODEL_NOT_FOUND, "model")
                assert "does not exist or you do not have access" in err.value.message
            assert [a.name for a in await registry.visible("beta")] == ["shared/legal", "tone"]
            assert [a.name for a in await registry.visible("acme")] == [
                "acme-support", "shared/legal", "tone"]
            assert await client.ttl(keys.adapters()) == -1  # kept until removed
            assert await registry.remove("acme-support") and not await registry.remove("x")
            with pytest.raises(NotFoundError):
                await registry.resolve("acme", "acme-support")
        finally:
            await client.aclose()

    run(scenario())


def test_each_adapter_belongs_to_one_base_model(redis_url) -> None:
    """Two base models: an adapter resolves with its own base (the settings' or the one it was
    added for); one added for a model the cluster does not serve is refused, and one stored
    for a base that is gone resolves to a 404, not to another model."""
    async def scenario() -> None:
        client = connect(redis_url)
        try:
            registry = AdapterRegistry(client, {BASE: ("tone",), "big": ("legal",)},
                                       reserved=frozenset({"fast"}))
            assert await registry.resolve("t", "big") is None
            assert (await registry.resolve("t", "legal")).base == "big"
            await registry.add(Adapter("big-acme", "/shared/x", base="big"))
            assert (await registry.resolve("t", "big-acme")).base == "big"
            for adapter, param in ((Adapter("fast", "/p"), "name"),
                                   (Adapter("y", "/p", base="gone"), "base")):
                with pytest.raises(InvalidRequestError) as err:
                    await registry.add(adapter)
                assert err.value.param == param
            await AdapterRegistry(client, {}).add(Adapter("orphan", "/p", base="gone"))
            with pytest.raises(NotFoundError):  # its base is not served here
                await registry.resolve("t", "orphan")
        finally:
            await client.aclose()

    run(scenario())


@pytest.mark.parametrize(("adapter", "param"), [
    (Adapter("-bad", "/p"), "name"), (Adapter("a" * 129, "/p"), "name"),
    (Adapter(BASE, "/p"), "name"), (Adapter("tone", "/p"), "name"), (Adapter("ok", None), "path")])
def test_a_bad_adapter_is_refused_naming_the_field(redis_url, adapter: Adapter, param: str
                                                   ) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        try:
            with pytest.raises(InvalidRequestError) as err:
                await AdapterRegistry(client, {BASE: ("tone",)}).add(adapter)
            assert err.value.param == param
        finally:
            await client.aclose()

    run(scenario())


def test_a_tenants_allow_list_of_models_is_checked_in_the_admission(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme", models=[BASE, "tone"]), Tenant(id="beta"))
            for rid, model in (("r1", BASE), ("r2", "tone"), ("r3", "")):
                await h.queues.admit(replace(make_request("acme", rid), model=model))
            with pytest.raises(NotFoundError) as err:
                await h.queues.admit(replace(make_request("acme", "r4"), model="legal"))
            assert (err.value.code, err.value.param) == (MODEL_NOT_FOUND, "model")
            assert await h.queues.depth("acme") == 3  # the refused one left nothing
            await h.queues.admit(replace(make_request("beta", "r5"), model="legal"))

    run(scenario())


def test_past_the_bound_a_new_adapter_is_refused_and_a_known_one_repointed(redis_url) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        try:
            registry = AdapterRegistry(client, {BASE: ()})
            async with client.pipeline(transaction=False) as pipe:
                for i in range(MAX_ADAPTERS - 1):
                    pipe.hset(keys.adapters(), f"filler-{i}", "{}")
                await pipe.execute()
            await registry.add(Adapter("last", "/p"))  # the 10,000th
            with pytest.raises(InvalidRequestError) as err:
                await registry.add(Adapter("one-more", "/p"))
            assert err.value.param == "name" and "at most 10000" in err.value.message
            await registry.add(Adapter("last", "/elsewhere"))  # repointing takes no room
            assert (await registry.resolve("t", "last")).path == "/elsewhere"
            assert await client.hlen(keys.adapters()) == MAX_ADAPTERS
        finally:
            await client.aclose()

    run(scenario())
