"""Property tests of the grant script over random arrivals (hypothesis, real Redis):
weighted fair share by token cost, no starvation, strict priority classes."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.messages import AdmitRequest
from router.state.tenants import Tenant
from tests.router.factories import harness, run

PROPERTY_SETTINGS = settings(
    max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
REQUESTS_PER_WEIGHT = 100
MAX_COST = 100


def _request(tenant_id: str, index: int, cost: int, priority_tag: str = "") -> AdmitRequest:
    prompt = cost // 2
    return AdmitRequest(tenant_id, f"r{index}", prompt, cost - prompt,
                        json.dumps({"i": index, "p": priority_tag}))


async def _drain(h, grant_size: int) -> list[tuple[str, int]]:
    """Grant everything in batches, completing each at its expected cost (no correction)."""
    order: list[tuple[str, int]] = []
    while True:
        batch = (await h.queues.grant("d", grant_size, grant_size)).grants
        if not batch:
            return order
        order.extend((g.tenant_id, g.prompt_tokens + g.max_tokens) for g in batch)
        await h.queues.complete_many([(g.lease, g.prompt_tokens, g.max_tokens, "stop")
                                      for g in batch])


@st.composite
def contention(draw: st.DrawFn) -> tuple[list[int], list[list[int]]]:
    """Weights of 2-5 tenants and, per tenant, costs of REQUESTS_PER_WEIGHT * weight requests."""
    weights = draw(st.lists(st.integers(1, 4), min_size=2, max_size=5))
    costs = [draw(st.lists(st.integers(2, MAX_COST), min_size=REQUESTS_PER_WEIGHT * w,
                           max_size=REQUESTS_PER_WEIGHT * w)) for w in weights]
    return weights, costs


@PROPERTY_SETTINGS
@given(case=contention(), grant_size=st.sampled_from([1, 7, 32]))
def test_shares_of_granted_tokens_follow_weights_and_nobody_starves(
    redis_client, redis_url, case, grant_size
) -> None:
    weights, costs = case
    redis_client.flushall()

    async def scenario() -> list[tuple[str, int]]:
        async with harness(redis_url) as h:
            requests = []
            for i, w in enumerate(weights):
                await h.tenants.add(Tenant(id=f"t{i}", weight=w))
                requests += [_request(f"t{i}", j, c) for j, c in enumerate(costs[i])]
            # arrivals interleaved across tenants, all queued before the first grant
            requests.sort(key=lambda r: int(r.request_id[1:]))
            await h.queues.admit_many(requests)
            return await _drain(h, grant_size)

    order = run(scenario())
    assert len(order) == sum(len(c) for c in costs)
    # the window of contention: until the first tenant has had its last request
    remaining = {f"t{i}": len(c) for i, c in enumerate(costs)}
    window = 0
    for window, (tenant_id, _) in enumerate(order, start=1):  # noqa: B007
        remaining[tenant_id] -= 1
        if remaining[tenant_id] == 0:
            break
    granted = dict.fromkeys(remaining, 0)
    for tenant_id, cost in order[:window]:
        granted[tenant_id] += cost
    total, weight_sum = sum(granted.values()), sum(weights)
    for i, w in enumerate(weights):
        share, fair = granted[f"t{i}"] / total, w / weight_sum
        assert abs(share - fair) <= 0.05 * fair, (i, share, fair)
    # no starvation: between two grants of a backlogged tenant, each other tenant gets at most
    # the requests that fit in one largest request of this tenant's virtual time, plus one
    min_cost = min(min(c) for c in costs)
    for i, w in enumerate(weights):
        bound = sum(MAX_COST / w * wj / min_cost + 1 for j, wj in enumerate(weights) if j != i)
        last = -1
        for position, (tenant_id, _) in enumerate(order[:window]):
            if tenant_id == f"t{i}":
                assert position - last - 1 <= bound, (i, position, last, bound)
                last = position


@st.composite
def arrivals(draw: st.DrawFn) -> tuple[list[int], list[tuple[str, int]]]:
    """Priority classes of 2-4 tenants and a random sequence of ("admit", tenant) and
    ("grant", n) steps."""
    priorities = draw(st.lists(st.integers(0, 3), min_size=2, max_size=4))
    steps = draw(st.lists(
        st.one_of(st.tuples(st.just("admit"), st.integers(0, len(priorities) - 1)),
                  st.tuples(st.just("grant"), st.integers(1, 4))),
        min_size=1, max_size=120))
    return priorities, steps


@PROPERTY_SETTINGS
@given(case=arrivals())
def test_priority_classes_are_strict_and_each_tenant_is_fifo(redis_client, redis_url, case) -> None:
    priorities, steps = case
    redis_client.flushall()

    async def scenario() -> None:
        async with harness(redis_url) as h:
            for i, p in enumerate(priorities):
                await h.tenants.add(Tenant(id=f"t{i}", priority=p, weight=1 + i))
            queued: list[list[int]] = [[] for _ in priorities]  # the model: ids per tenant
            next_id = 0
            for op, arg in [*steps, ("grant", 10_000)]:
                if op == "admit":
                    await h.queues.admit(_request(f"t{arg}", next_id, 10 + next_id % 50))
                    queued[arg].append(next_id)
                    next_id += 1
                    continue
                for g in (await h.queues.grant("d", arg, 10_000)).grants:
                    tenant = int(g.tenant_id[1:])
                    top = max(priorities[i] for i, q in enumerate(queued) if q)
                    assert priorities[tenant] == top, (priorities, tenant, queued)
                    assert int(g.request_id[1:]) == queued[tenant].pop(0)  # FIFO per tenant
            assert not any(queued)

    run(scenario())
