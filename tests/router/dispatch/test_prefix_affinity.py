"""Prefix-cache-aware replica choice: block hashes as the engine keys them, the per-replica
index of what was sent where, and the ranking that balances affinity against load."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import pytest

from replicas.protocol import (
    PUBLISHED_ADAPTERS,
    CallAdapter,
    CallSampling,
    CallStream,
    ReplicaCall,
    adapter_salt,
    cache_root,
    hash_block_tokens,
)
from router.dispatch.prefix_affinity import (
    OwnLoads,
    PrefixAffinityRouter,
    PrefixIndex,
    block_hashes,
    published_match,
    rank_by_affinity,
)

BS = 4


def test_block_hashes_chain_full_blocks_like_the_engine() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2  # the partial third block is not cacheable
    first = hash_block_tokens(None, (0, 1, 2, 3))
    assert hashes == [first, hash_block_tokens(first, (4, 5, 6, 7))]
    assert block_hashes(tokens[:8] + [99, 98, 97, 96], BS)[:2] == hashes
    assert block_hashes([7] + tokens[1:], BS)[1] != hashes[1]  # the chain: all differ after
    assert block_hashes([1, 2, 3], BS) == []


def test_index_matches_leading_blocks_and_forgets_the_least_recently_sent() -> None:
    index = PrefixIndex(max_blocks=5)
    a, b = block_hashes(list(range(12)), BS), block_hashes(list(range(100, 112)), BS)
    index.record("r1", a)
    assert index.matched_blocks("r1", a) == 3
    assert index.matched_blocks("r1", a[:2] + b[2:]) == 2
    assert index.matched_blocks("r2", a) == 0
    index.record("r1", b)  # 6 blocks: a's first block, the least recently sent, goes
    assert index.num_blocks("r1") == 5
    assert index.matched_blocks("r1", a) == 0  # chained: nothing after a missing first block
    assert index.matched_blocks("r1", b) == 3
    index.record("r1", b[:1])  # touched again: now a[1] is the oldest
    index.record("r1", a[:1])
    assert index.matched_blocks("r1", b) == 3
    index.keep_only({"r2"})
    assert index.num_blocks("r1") == 0
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(0)


def test_published_match_counts_leading_blocks_of_a_replicas_cached_set() -> None:
    hashes = block_hashes(list(range(16)), BS)
    assert published_match(set(hashes[:2]) | {hashes[3]}, hashes) == 2
    assert published_match(set(), hashes) == 0


def test_rank_prefers_the_longest_match_then_the_least_loaded() -> None:
    rng = random.Random(0)
    order = rank_by_affinity({"a": 3, "b": 5, "c": 0}, {"a": 0, "b": 2, "c": 1}, 1, 8, rng)
    assert order == ["b", "a", "c"]  # then the others, least loaded first
    tie = rank_by_affinity({"a": 4, "b": 4}, {"a": 3, "b": 1}, 1, 8, rng)
    assert tie == ["b", "a"]


def test_rank_gives_way_to_load_beyond_the_imbalance_and_to_weak_matches() -> None:
    rng = random.Random(0)
    # b matches best but holds 9 more requests than a: a takes it if it matches at all
    assert rank_by_affinity({"a": 1, "b": 5}, {"a": 0, "b": 9}, 1, 8, rng) == ["a", "b"]
    # nothing eligible: the caller's load-only choice
    assert rank_by_affinity({"a": 0, "b": 5}, {"a": 0, "b": 9}, 1, 8, rng) is None
    assert rank_by_affinity({"a": 1, "b": 1}, {"a": 0, "b": 0}, 2, 8, rng) is None
    # an unknown load does not rule a replica out (Ray probes it when it tries)
    assert rank_by_affinity({"a": 0, "b": 5}, {"a": 0, "b": None}, 1, 8, rng) == ["b", "a"]


def test_own_loads_count_picks_at_once_follow_the_route_and_end_with_the_request() -> None:
    now = [0.0]
    own = OwnLoads(pick_ttl_s=5.0, clock=lambda: now[0])
    own.picked("r1", "a")
    own.picked("r2", "a")
    assert own.count("a") == 2  # before Ray has sent either
    own.routed("r1", "a")
    own.routed("r2", "b")  # Ray took the next rank for r2
    assert (own.count("a"), own.count("b")) == (1, 1)
    own.picked("r2", "a")  # a late re-pick of a routed request moves it, never doubles it
    assert (own.count("a"), own.count("b")) == (2, 0)
    own.completed("r1")
    own.completed("r2")
    own.completed("r2")  # twice, or never seen: nothing goes negative
    own.completed("unknown")
    assert (own.count("a"), own.count("b")) == (0, 0)
    # a pick never routed (its caller went away) is forgotten after the ttl; routed ones stay
    own.picked("lost", "a")
    own.routed("long", "b")
    now[0] = 6.0
    own.picked("r3", "b")
    assert (own.count("a"), own.count("b")) == (0, 2)
    own.forget("b")
    assert own.count("b") == 0
    own.completed("long")
    assert own.count("b") == 0


def test_a_burst_with_no_known_loads_still_respects_the_imbalance() -> None:
    """Sixteen requests sharing a prefix cached on "a", all ranked before Ray has sent any
    (its cache empty): the router's own picks keep "a" within max_imbalance of "b"."""
    rng = random.Random(0)
    own = OwnLoads()
    placed = []
    for i in range(16):
        loads = {r: max(0, own.count(r)) for r in ("a", "b")}  # Ray's cache: unknown (0)
        order = rank_by_affinity({"a": 3, "b": 0}, loads, 1, 8, rng)
        replica = order[0] if order is not None else min(loads, key=loads.__getitem__)
        own.picked(f"r{i}", replica)
        placed.append(replica)
    assert placed.count("a") <= placed.count("b") + 8 + 1
    assert placed.count("b") >= 3 and placed[:9] == ["a"] * 9


def test_the_router_hashes_the_prompt_of_the_replica_call_it_routes() -> None:
    """What Ray Serve hands the request router is the dispatcher's ``ReplicaCall``: its prompt's
    blocks are what the router looks for (a call it cannot read would route blind)."""
    call = ReplicaCall("r.1.0", tuple(range(10)), CallSampling(max_tokens=4),
                       CallStream("t", "r", "router-1", 1, "1.0"))
    pending = SimpleNamespace(args=[call])
    router = SimpleNamespace(block_size=BS, _call=PrefixAffinityRouter._call)
    assert PrefixAffinityRouter._hashes(router, pending) == block_hashes(list(range(10)), BS)
    assert PrefixAffinityRouter._hashes(router, SimpleNamespace(args=[{"x": 1}])) == []
    # a tenant's call is hashed in its own prefix-cache partition, as its replica caches it
    salted = dataclasses.replace(call, cache_salt="acme")
    hashes = PrefixAffinityRouter._hashes(router, SimpleNamespace(args=[salted]))
    assert hashes == block_hashes(list(range(10)), BS, "acme")
    assert hashes[0] == hash_block_tokens(cache_root("acme"), tuple(range(BS)))
    assert not set(hashes) & set(block_hashes(list(range(10)), BS))
    # an adapter's call in the adapter's partition (the engine's: replicas/torch_engine/engine_core)
    tuned = dataclasses.replace(salted, adapter=CallAdapter("tone"))
    assert PrefixAffinityRouter._hashes(router, SimpleNamespace(args=[tuned])) == block_hashes(
        list(range(10)), BS, adapter_salt("acme", "tone")) != hashes


def test_an_adapters_request_goes_to_a_replica_holding_it_unless_that_one_is_overloaded(
        ) -> None:
    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(block_size=BS)
    router._queue_len = lambda replica: None  # Ray's queue-length cache knows nothing yet

    def replica(rid: str, adapters: list[str]) -> SimpleNamespace:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                               routing_stats={PUBLISHED_ADAPTERS: adapters})

    replicas = [replica("a", []), replica("b", ["tone"]), replica("c", ["other"])]
    call = ReplicaCall("r.1.0", (1, 2), CallSampling(max_tokens=4),  # shorter than a block
                       CallStream("t", "r", "router-1", 1, "1.0"), adapter=CallAdapter("tone"))

    def first(request_id: str, the_call: ReplicaCall = call) -> str:
        pending = SimpleNamespace(args=[the_call],
                                  metadata=SimpleNamespace(internal_request_id=request_id))
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        return ranks[0][0].replica_id.unique_id

    # b holds it: b, until it has more than max_imbalance (8) requests beyond the least loaded
    assert [first(f"q{i}") for i in range(9)] == ["b"] * 9
    assert first("late") != "b"
    # one this router sent there counts as held too, before the replica publishes it
    router.on_request_routed(SimpleNamespace(args=[dataclasses.replace(
        call, adapter=CallAdapter("fresh"))], metadata=SimpleNamespace(internal_request_id="s")),
        SimpleNamespace(unique_id="c"), None)
    assert router._holds(replicas[2], "fresh") and not router._holds(replicas[0], "fresh")


def test_a_call_that_left_a_replica_is_not_ranked_there_while_another_can_take_it() -> None:
    """A frozen replica looks idle and holds the prompt's blocks: the request that moved away
    from it would be ranked there first again, and wait until Ray Serve's health checks drop
    it. ``avoid`` keeps it off every rank, unless it is the only candidate."""
    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(block_size=BS)
    router._queue_len = lambda replica: None

    def replica(rid: str) -> SimpleNamespace:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={})

    frozen, busy = replica("frozen"), replica("busy")
    call = ReplicaCall("r.1.0", tuple(range(4 * BS)), CallSampling(max_tokens=4),
                       CallStream("t", "r", "router-1", 1, "1.0"))
    pending = SimpleNamespace(args=[call], metadata=SimpleNamespace(internal_request_id="r"))
    router.on_request_routed(pending, SimpleNamespace(unique_id="frozen"), None)
    router.own_loads.completed("r")
    for i in range(4):  # the other replica is busier
        router.own_loads.routed(f"b{i}", "busy")

    def ranks(the_call: ReplicaCall, candidates: list) -> list[list[str]]:
        moved = SimpleNamespace(args=[the_call], metadata=SimpleNamespace(internal_request_id="m"))
        return [[r.replica_id.unique_id for r in rank]
                for rank in asyncio.run(router.choose_replicas(candidates, moved))]

    assert ranks(call, [frozen, busy])[0] == ["frozen"]  # its blocks, and idle: first
    left = dataclasses.replace(call, avoid=("frozen",))
    assert ranks(left, [frozen, busy]) == [["busy"], []]
    assert ranks(left, [frozen]) == [["frozen"], []]  # the only one: still tried
