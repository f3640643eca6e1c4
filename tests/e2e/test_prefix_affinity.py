"""Prefix-cache-aware replica choice on the real two-replica, two-router cluster: a
conversation's follow-up turns go where its history is cached, and ``/metrics`` counts the
cached prompt tokens."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from cluster.benchmarks.engine_bench import WORDS
from router.state.tenants import Tenant
from router.telemetry.metrics import SNAPSHOT_S
from tests.e2e.factories import MODEL, E2ECluster
from tests.e2e.test_metrics import _scrape, _value

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK_SIZE = 16  # engine.block_size's default: the prefix cache's unit
PUBLISH_WAIT_S = 3.0  # > replicas.routing.publish_period_s (1 s) and Ray's hand-over to routers


def test_follow_up_turns_land_where_their_history_is_cached(e2e: E2ECluster) -> None:
    """Without affinity each follow-up goes to either replica (the less loaded of two, both
    idle): all three finding their history cached would happen one time in eight."""
    key = e2e.add_tenant(Tenant(id="affinity"))
    rng = random.Random(20)
    before = _scrape(e2e)
    messages = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(200))}]
    client = e2e.client(key)
    turns = []
    for turn in range(4):
        messages.append({"role": "user",
                         "content": f"Turn {turn}: " + " ".join(rng.choice(WORDS) for _ in range(30))})
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        usage = response.usage
        turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        if turn < 3:
            time.sleep(PUBLISH_WAIT_S)  # every router has heard what each replica cached
    for (previous_prompt, _), (prompt, cached) in zip(turns, turns[1:], strict=False):
        # the previous turn's prompt, up to its last full block, was served from the cache
        assert cached >= previous_prompt // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE, turns
        assert cached < prompt
    total_cached = sum(cached for _, cached in turns)
    time.sleep(SNAPSHOT_S + 0.5)
    for _ in range(2):  # either router answers with the whole cluster's counts
        after = _scrape(e2e)
        name = "fairserve_cached_prompt_tokens_total"
        assert _value(after, name, tenant="affinity") - _value(before, name, tenant="affinity") \
            == total_cached
        hist = "fairserve_cached_prompt_tokens_per_request_count"
        assert _value(after, hist, tenant="affinity") == len(turns)


def cached_tokens_by_tenant(e2e: E2ECluster, seed: int, tenants: list[Tenant]
                            ) -> Callable[[str], int]:
    """A function that sends one fixed 120-word prompt as a tenant (by id) and returns the
    prompt tokens its answer says were cached."""
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(120))
    clients = {tenant.id: e2e.client(e2e.add_tenant(tenant)) for tenant in tenants}

    def cached(name: str) -> int:
        response = clients[name].completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                                    temperature=0.0)
        return response.usage.prompt_tokens_details.cached_tokens

    return cached


def test_a_tenant_gets_no_cached_tokens_from_another_tenant_s_prompt(e2e: E2ECluster) -> None:
    """Each tenant has its own prefix-cache partition: tenant B sending what tenant A sent
    a moment ago gets 0 cached tokens (it cannot probe A's prompts 16 tokens at a time),
    while A's own repeat is served from the cache."""
    cached = cached_tokens_by_tenant(e2e, 28, [Tenant(id="salted-a"), Tenant(id="salted-b")])
    assert cached("salted-a") == 0
    time.sleep(PUBLISH_WAIT_S)  # the routers know where A's blocks are
    assert cached("salted-b") == 0
    assert cached("salted-a") >= BLOCK_SIZE * 4


def test_tenants_of_one_cache_group_share_the_prefix_cache(e2e: E2ECluster) -> None:
    """Opt-in sharing: tenants that name the same cache group are served from each other's
    cached prefixes (and can tell what the other sent); a tenant outside it still gets none."""
    cached = cached_tokens_by_tenant(e2e, 2828, [Tenant(id="group-a", cache_group="team"),
                                                 Tenant(id="group-b", cache_group="team"),
                                                 Tenant(id="loner")])
    assert cached("group-a") == 0
    time.sleep(PUBLISH_WAIT_S)  # the routers know where A's blocks are
    assert cached("loner") == 0
    assert cached("group-b") >= BLOCK_SIZE * 4
