"""8 dispatcher processes against one Redis, 5,000 requests from 10 tenants: no duplicate
grant, no loss, fair shares within 5% while every tenant has backlog."""

from __future__ import annotations

import asyncio
import multiprocessing
import random

import pytest

from router.messages import RequestState
from router.state.tenants import Tenant
from tests.router.factories import harness, make_request, run

WEIGHTS = [1, 1, 1, 1, 2, 2, 2, 3, 3, 4]
REQUESTS_PER_WEIGHT = 250  # 5,000 in all
NUM_DISPATCHERS = 8
SLOTS_PER_DISPATCHER = 4


def _dispatch(url: str, holder: str) -> list[tuple[int, str, str, int]]:
    """One dispatcher process: grant up to its free slots, complete, until the queues are empty.
    Returns (grant sequence, tenant, request id, cost) per grant."""

    async def loop() -> list[tuple[int, str, str, int]]:
        seen: list[tuple[int, str, str, int]] = []
        async with harness(url) as h:
            while True:
                batch = (await h.queues.grant(holder, SLOTS_PER_DISPATCHER)).grants
                if not batch:
                    return seen
                seen += [(g.grant_seq, g.tenant_id, g.request_id, g.prompt_tokens + g.max_tokens)
                         for g in batch]
                refunds = await h.queues.complete_many(
                    [(g.lease, g.prompt_tokens, g.max_tokens, "stop") for g in batch])
                assert None not in refunds, "a lease this dispatcher holds was lost"

    return asyncio.run(loop())


@pytest.mark.slow
def test_eight_dispatchers_share_fairly_without_duplicates_or_loss(redis_url) -> None:
    rng = random.Random(3)
    per_tenant = {f"t{i}": [rng.randint(2, 100) for _ in range(REQUESTS_PER_WEIGHT * w)]
                  for i, w in enumerate(WEIGHTS)}

    async def setup() -> None:
        async with harness(redis_url) as h:
            for i, w in enumerate(WEIGHTS):
                await h.tenants.add(Tenant(id=f"t{i}", weight=w, max_queued=10_000))
            requests = [make_request(t, f"r{j}", prompt_tokens=c // 2, max_tokens=c - c // 2)
                        for t, costs in per_tenant.items() for j, c in enumerate(costs)]
            rng.shuffle(requests)
            for start in range(0, len(requests), 500):
                results = await h.queues.admit_many(requests[start:start + 500])
                assert all(not isinstance(r, Exception) for r in results)

    run(setup())
    context = multiprocessing.get_context("spawn")
    with context.Pool(NUM_DISPATCHERS) as pool:
        outputs = pool.starmap(_dispatch, [(redis_url, f"d{k}") for k in range(NUM_DISPATCHERS)])

    grants = sorted(g for output in outputs for g in output)
    total_requests = sum(len(c) for c in per_tenant.values())
    assert len(grants) == total_requests
    assert len({(t, r) for _, t, r, _ in grants}) == total_requests  # no duplicate, no loss
    assert [seq for seq, *_ in grants] == list(range(1, total_requests + 1))
    assert sum(1 for output in outputs if output) > 1, "the dispatchers did not run concurrently"

    async def states() -> set[RequestState]:
        async with harness(redis_url) as h:
            return {(await h.queues.get(t, f"r{j}")).state
                    for t, costs in per_tenant.items() for j in range(len(costs))}

    assert run(states()) == {RequestState.COMPLETED}
    # shares of granted tokens in global grant order, while every tenant still had backlog
    remaining = {t: len(c) for t, c in per_tenant.items()}
    granted = dict.fromkeys(per_tenant, 0)
    for _, tenant_id, _, cost in grants:
        granted[tenant_id] += cost
        remaining[tenant_id] -= 1
        if remaining[tenant_id] == 0:
            break
    total, weight_sum = sum(granted.values()), sum(WEIGHTS)
    for i, w in enumerate(WEIGHTS):
        share, fair = granted[f"t{i}"] / total, w / weight_sum
        assert abs(share - fair) <= 0.05 * fair, (f"t{i}", share, fair)
