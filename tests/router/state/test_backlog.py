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
