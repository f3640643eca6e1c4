"""The backlog script: queued requests and tokens and leased requests per tenant; the grant
returns the priority and the queue depth at admission (for the queue span) and the tenant's
weight (for the replica's fair scheduler)."""

from __future__ import annotations

from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, make_request, run


def test_backlog_counts_queued_tokens_and_leases(redis_server, redis_client) -> None:
    async def scenario() -> None:
        async with harness(redis_server.url) as h:
            await add_tenants(h, Tenant(id="a", priority=1, weight=2.5), Tenant(id="b"),
                              Tenant(id="idle"))
            for i in range(3):
                await h.queues.admit(make_request("a", f"a{i}", prompt_tokens=10, max_tokens=20))
            await h.queues.admit(make_request("b", "b0", prompt_tokens=5, max_tokens=7,
                                              expected_output_tokens=3))
            before = {b.tenant_id: b for b in await h.queues.backlog()}
            assert (before["a"].priority, before["a"].num_queued, before["a"].queued_tokens,
                    before["a"].num_leased) == (1, 3, 90, 0)
            assert (before["b"].num_queued, before["b"].queued_tokens) == (1, 8)
            assert (before["idle"].num_queued, before["idle"].queued_tokens) == (0, 0)

            batch = await h.queues.grant("d1", free_slots=2)
            assert [(g.tenant_id, g.priority, g.admit_depth, g.weight) for g in batch.grants] == [
                ("a", 1, 1, 2.5), ("a", 1, 2, 2.5)]  # the higher class first, in admission order
            after = {b.tenant_id: b for b in await h.queues.backlog()}
            assert (after["a"].num_queued, after["a"].queued_tokens, after["a"].num_leased) == \
                (1, 30, 2)
            assert after["b"].num_leased == 0
            (b_grant,) = (await h.queues.grant("d1", free_slots=5)).grants[1:]
            assert (b_grant.tenant_id, b_grant.weight) == ("b", 1.0)

    run(scenario())


def test_queued_tokens_are_kept_as_requests_move_and_match_a_scan(redis_url) -> None:
    """The backlog reads each tenant's queued cost from a counter kept by admit, grant,
    requeue and cancel (a scrape costs O(tenants), not O(queued requests)); after a random mix
    of those moves it equals the sum over what the queues hold."""
    import random

    from router.state import keys

    async def scan(h, tenant_id: str) -> int:
        ids = [i.decode() for i in await h.client.lrange(keys.queue(tenant_id), 0, -1)]
        costs = [await h.client.hget(keys.request(tenant_id, rid), "cost") for rid in ids]
        return sum(int(c) for c in costs)

    async def scenario() -> None:
        rng = random.Random(7)
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="a", max_queued=10_000), Tenant(id="b", weight=3))
            leases, n = [], 0
            for _ in range(300):
                move = rng.random()
                if move < 0.45:
                    tenant = rng.choice("ab")
                    n += 1
                    await h.queues.admit(make_request(
                        tenant, f"r{n}", prompt_tokens=rng.randint(1, 50),
                        max_tokens=rng.randint(1, 40), num_choices=rng.randint(1, 3)))
                elif move < 0.7:
                    leases += [g.lease for g in
                               (await h.queues.grant("d", rng.randint(1, 4))).grants]
                elif move < 0.85 and leases:
                    await h.queues.requeue(leases.pop(rng.randrange(len(leases))), "test")
                else:
                    tenant = rng.choice("ab")
                    queued = await h.queues.queued_ids(tenant)
                    if queued:
                        await h.queues.cancel(tenant, rng.choice(queued))
                backlog = {b.tenant_id: b for b in await h.queues.backlog()}
                for tenant in "ab":
                    assert backlog[tenant].queued_tokens == await scan(h, tenant), tenant
            assert n > 100
            # a scrape's cost does not grow with what waits: Redis counts the commands it ran
            await h.queues.admit_many([make_request("a", f"bulk{i}") for i in range(2_000)])
            await h.client.config_resetstat()
            backlog = {b.tenant_id: b for b in await h.queues.backlog()}
            assert backlog["a"].num_queued >= 2_000
            stats = await h.client.info("commandstats")
            reads = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0)
                        for c in ("hget", "hmget", "lrange", "lindex"))
            assert reads <= 2 * len(backlog), stats

    run(scenario())


def test_a_grant_carries_the_prefix_cache_salt_of_its_tenant_or_its_group(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="a", cache_group="partners"),
                              Tenant(id="b", cache_group="partners"), Tenant(id="c"),
                              Tenant(id="partners"))
            for tenant in ("a", "b", "c", "partners"):
                await h.queues.admit(make_request(tenant, f"{tenant}0"))
            grants = {g.tenant_id: g for g in (await h.queues.grant("d", 10)).grants}
            salts = {t: g.cache_salt for t, g in grants.items()}
            assert salts == {"a": "group:partners", "b": "group:partners", "c": "c",
                             "partners": "partners"}  # a group never meets a tenant's own

    run(scenario())
