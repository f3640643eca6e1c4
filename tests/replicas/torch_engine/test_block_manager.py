"""BlockManager: allocation, reference counts, prefix hits, collisions and LRU eviction."""

from __future__ import annotations

import pytest

from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine import block_manager as block_manager_module
from replicas.torch_engine.block_manager import BlockManager
from replicas.torch_engine.sequence import Sequence
from tests.replicas.torch_engine.factories import make_sequence


def compute(bm: BlockManager, seq: Sequence, num_new_tokens: int) -> list[int]:
    """What one engine step does for ``seq``: get slots, 'compute' the KV, cache full blocks."""
    new_block_ids = bm.allocate_slots(seq, num_new_tokens)
    assert new_block_ids is not None
    seq.num_computed_tokens += num_new_tokens
    bm.cache_full_blocks(seq, seq.num_computed_tokens)
    bm.check_invariants()
    return new_block_ids


def prefill(bm: BlockManager, seq: Sequence) -> int:
    num_cached_tokens = bm.allocate_prefix(seq)
    compute(bm, seq, seq.num_uncomputed_tokens)
    return num_cached_tokens


def ref_counts(bm: BlockManager, block_ids: list[int]) -> list[int]:
    return [bm.blocks[block_id].ref_count for block_id in block_ids]


def test_fresh_manager_is_all_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_total_blocks, bm.num_free_blocks, bm.num_used_blocks) == (8, 8, 0)
    bm.check_invariants()


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)


def test_allocate_slots_rounds_up_to_blocks_and_free_releases_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_sequence("a", num_prompt_tokens=10)
    new_block_ids = bm.allocate_slots(seq, 10)
    assert new_block_ids is not None and len(new_block_ids) == 3
    assert seq.block_ids == new_block_ids
    assert ref_counts(bm, seq.block_ids) == [1, 1, 1]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 3)
    bm.check_invariants()

    bm.free(seq)
    assert seq.block_ids == [] and seq.block_hashes == []
    assert ref_counts(bm, new_block_ids) == [0, 0, 0]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    bm.check_invariants()


def test_allocate_slots_only_adds_missing_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_sequence("a", num_prompt_tokens=6)
    compute(bm, seq, 6)
    assert len(seq.block_ids) == 2
    assert bm.allocate_slots(seq, 2) == []  # tokens 6 and 7 fit in block 1
    assert len(bm.allocate_slots(seq, 3) or []) == 1
    bm.check_invariants()


def test_allocate_slots_returns_none_and_allocates_nothing_when_short() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_sequence("a", num_prompt_tokens=12)
    compute(bm, first, 12)
    second = make_sequence("b", num_prompt_tokens=8)
    assert bm.allocate_slots(second, 8) is None
    assert second.block_ids == []
    assert (bm.num_free_blocks, bm.num_used_blocks) == (1, 3)
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_skips_their_prefill() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_sequence("a", num_prompt_tokens=10)
    assert prefill(bm, first) == 0
    assert len(first.block_hashes) == 2  # two full blocks; the third holds 2 tokens

    second = make_sequence("b", token_ids=first.token_ids + [1, 2, 3])
    assert bm.allocate_prefix(second) == 8
    assert second.num_computed_tokens == 8
    assert second.block_ids == first.block_ids[:2]
    assert second.block_hashes == first.block_hashes
    assert ref_counts(bm, second.block_ids) == [2, 2]
    bm.check_invariants()

    new_block_ids = compute(bm, second, second.num_uncomputed_tokens)
    assert len(new_block_ids) == 2  # tokens 8..12: blocks 2 and 3 are second's own
    assert bm.num_used_blocks == 3 + 2

    bm.free(first)
    assert ref_counts(bm, second.block_ids[:2]) == [1, 1]
    bm.free(second)
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.check_invariants()


def test_prefix_hit_on_free_cached_blocks_takes_them_out_of_the_free_queue() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_sequence("a", num_prompt_tokens=9)
    prefill(bm, first)
    cached_block_ids = first.block_ids[:2]
    bm.free(first)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2

    again = make_sequence("a2", token_ids=list(first.token_ids))
    assert bm.allocate_prefix(again) == 8
    assert again.block_ids == cached_block_ids
    assert all(block_id not in bm.free_queue for block_id in cached_block_ids)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (6, 2)
    bm.check_invariants()


def test_block_aligned_prompt_leaves_one_block_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_sequence("a", num_prompt_tokens=8)
    prefill(bm, first)
    assert bm.num_cached_blocks == 2

    same = make_sequence("b", token_ids=list(first.token_ids))
    assert bm.allocate_prefix(same) == 4  # not 8: the last token must be computed
    assert same.num_uncomputed_tokens == 4
    compute(bm, same, 4)
    # Block 1 of `same` holds the same tokens as block 1 of `first`: the first mapping stays.
    assert same.block_hashes == first.block_hashes
    assert bm.hash_to_block_id[same.block_hashes[1]] == first.block_ids[1]
    assert bm.blocks[same.block_ids[1]].block_hash is None
    assert bm.num_cached_blocks == 2

    bm.free(first)
    bm.free(same)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_one_token_prompt_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=1)
    first = make_sequence("a", token_ids=[5])
    prefill(bm, first)
    assert bm.allocate_prefix(make_sequence("b", token_ids=[5])) == 0


def test_hit_stops_at_the_first_missing_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    first = make_sequence("a", token_ids=[1, 2, 3, 4, 5, 6, 7])
    prefill(bm, first)
    # Same first and third block, different second: the chain breaks after one block.
    other = make_sequence("b", token_ids=[1, 2, 9, 9, 5, 6, 7])
    assert bm.allocate_prefix(other) == 2
    assert other.block_ids == first.block_ids[:1]
    bm.check_invariants()


def test_hash_collision_with_other_tokens_does_not_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_sequence("a", token_ids=[1, 2, 3, 4, 0])
    prefill(bm, first)
    assert bm.hash_to_block_id == {42: first.block_ids[0]}

    other = make_sequence("b", token_ids=[5, 6, 7, 8, 0])
    assert bm.allocate_prefix(other) == 0  # same hash, other tokens: a miss
    assert other.block_ids == [] and other.num_computed_tokens == 0
    compute(bm, other, other.num_uncomputed_tokens)
    # The colliding block is not registered; the first mapping is kept.
    assert bm.hash_to_block_id == {42: first.block_ids[0]}
    assert bm.blocks[other.block_ids[0]].block_hash is None
    bm.free(first)
    bm.free(other)
    bm.check_invariants()


def test_hash_collision_with_other_parent_does_not_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hash that forgets the parent: equal blocks after different prefixes collide.
    monkeypatch.setattr(
        block_manager_module, "hash_block_tokens", lambda parent, tokens: hash(tokens)
    )
    bm = BlockManager(num_blocks=16, block_size=2)
    first = make_sequence("a", token_ids=[1, 2, 9, 9, 0])
    second = make_sequence("b", token_ids=[3, 4, 8, 8, 0])
    prefill(bm, first)
    prefill(bm, second)

    probe = make_sequence("c", token_ids=[3, 4, 9, 9, 0])
    # Block 0 is second's; block 1's hash and tokens match first's block 1, but its parent
    # is first's block 0, not second's: only one block hits.
    assert bm.allocate_prefix(probe) == 2
    assert probe.block_ids == second.block_ids[:1]
    bm.check_invariants()


def test_eviction_takes_never_cached_blocks_then_least_recently_freed() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    first = make_sequence("a", token_ids=[1, 2, 3, 4, 0])
    second = make_sequence("b", token_ids=[5, 6, 7, 8, 0])
    prefill(bm, first)  # 3 blocks, 2 cached
    first_block_ids = list(first.block_ids)
    bm.free(first)
    assert bm.num_cached_blocks == 2
    # Freed blocks go to the end of the queue, tail first; never-used blocks stay in front.
    assert list(bm.free_queue)[-3:] == first_block_ids[::-1]
    prefill(bm, second)  # takes the 3 never-used blocks: nothing evicted
    assert bm.num_cached_blocks == 4
    bm.free(second)
    bm.check_invariants()

    # Allocating now evicts first's blocks (freed earlier), tail first.
    third = make_sequence("c", num_prompt_tokens=3)
    new_block_ids = bm.allocate_slots(third, 3)
    assert new_block_ids is not None and len(new_block_ids) == 2
    assert bm.num_cached_blocks == 3  # first's partial block had no hash, block 1 did
    bm.check_invariants()

    # first's block 0 survived, its block 1 was evicted; second is intact.
    assert bm.allocate_prefix(make_sequence("a2", token_ids=[1, 2, 3, 4, 0])) == 2
    assert bm.allocate_prefix(make_sequence("b2", token_ids=[5, 6, 7, 8, 0])) == 4
    bm.check_invariants()


def test_lru_order_is_the_order_of_freeing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seqs = [make_sequence(name, token_ids=[i, i, 0]) for i, name in enumerate("abcd")]
    for seq in seqs[:2]:
        prefill(bm, seq)  # each: 1 cached full block + 1 partial block
    recorded = [list(seq.block_ids) for seq in seqs[:2]]
    bm.free(seqs[1])
    bm.free(seqs[0])
    # b was freed first, tail first; then a, tail first.
    expected = [recorded[1][1], recorded[1][0], recorded[0][1], recorded[0][0]]
    assert list(bm.free_queue) == expected

    # Two blocks: b's partial block and b's cached block 0, which is evicted.
    taken = bm.allocate_slots(make_sequence("e", num_prompt_tokens=4), 4)
    assert taken == expected[:2]
    assert bm.allocate_prefix(make_sequence("b2", token_ids=[1, 1, 0])) == 0
    assert bm.allocate_prefix(make_sequence("a2", token_ids=[0, 0, 0])) == 2
    bm.check_invariants()


def test_cache_full_blocks_registers_only_full_computed_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_sequence("a", num_prompt_tokens=10)
    compute(bm, seq, 6)  # chunk 1: tokens 0..5
    assert len(seq.block_hashes) == 1 and bm.num_cached_blocks == 1
    compute(bm, seq, 4)  # chunk 2: tokens 6..9; block 2 holds 2 tokens
    assert len(seq.block_hashes) == 2 and bm.num_cached_blocks == 2
    assert bm.blocks[seq.block_ids[2]].block_hash is None

    bm.cache_full_blocks(seq, seq.num_computed_tokens)  # again: nothing new
    assert len(seq.block_hashes) == 2 and bm.num_cached_blocks == 2

    seq.append_token(11)
    seq.append_token(12)  # block 2 full of tokens, but token 11 is not computed yet
    bm.cache_full_blocks(seq, seq.num_computed_tokens)
    assert bm.num_cached_blocks == 2
    compute(bm, seq, 2)
    assert len(seq.block_hashes) == 3 and bm.num_cached_blocks == 3
    assert bm.blocks[seq.block_ids[2]].token_ids == tuple(seq.token_ids[8:12])


def test_chained_hashes_depend_on_the_whole_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    first = make_sequence("a", token_ids=[1, 2, 3, 4, 0])
    second = make_sequence("b", token_ids=[9, 9, 3, 4, 0])
    prefill(bm, first)
    prefill(bm, second)
    assert first.block_hashes[1] != second.block_hashes[1]
    assert bm.num_cached_blocks == 4


def test_prefix_caching_off_never_hits_or_registers() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_sequence("a", num_prompt_tokens=9)
    assert prefill(bm, first) == 0
    assert first.block_hashes == [] and bm.num_cached_blocks == 0
    assert bm.allocate_prefix(make_sequence("b", token_ids=list(first.token_ids))) == 0
    bm.check_invariants()


def test_with_token_kinds_a_block_of_generated_tokens_is_shared_only_with_the_same_boundary() -> None:
    """int4 engines compute prompt and generated tokens with different weights: a block that
    holds generated tokens is reused by a sequence whose prompt ends at the same place (a
    resumed or recomputed request), never as prompt of another (the next turn of a chat)."""
    bm = BlockManager(num_blocks=16, block_size=4, keys_token_kinds=True)
    first = Sequence.from_prompt("a", list(range(8)), SamplingParams())
    assert bm.allocate_prefix(first) == 0
    first.token_ids.extend([100, 101, 102, 103, 104])  # 5 generated tokens
    bm.allocate_slots(first, first.num_tokens)
    bm.cache_full_blocks(first, 12)
    bm.check_invariants()
    # the same request resumed: prompt 8 tokens + its 5 sent tokens -> all 3 full blocks hit
    resumed = Sequence.from_prompt("a2", list(range(8)), SamplingParams())
    resumed.token_ids.extend([100, 101, 102, 103, 104])
    assert bm.allocate_prefix(resumed) == 12
    # a next turn whose prompt holds the same 13 tokens: only the prompt-only blocks hit
    next_turn = Sequence.from_prompt("b", [*range(8), 100, 101, 102, 103, 104], SamplingParams())
    assert bm.allocate_prefix(next_turn) == 8
    bm.check_invariants()
    # without token kinds (float32, bfloat16) the next turn reuses all three blocks
    plain = BlockManager(num_blocks=16, block_size=4)
    seq = Sequence.from_prompt("a", list(range(8)), SamplingParams())
    plain.allocate_prefix(seq)
    seq.token_ids.extend([100, 101, 102, 103, 104])
    plain.allocate_slots(seq, seq.num_tokens)
    plain.cache_full_blocks(seq, 12)
    again = Sequence.from_prompt("b", [*range(8), 100, 101, 102, 103, 104], SamplingParams())
    assert plain.allocate_prefix(again) == 12


def test_cached_hashes_are_published_newest_first_with_a_version_that_tracks_changes() -> None:
    from router.dispatch.prefix_affinity import block_hashes  # the routers' view of a prompt

    bm = BlockManager(num_blocks=6, block_size=2)
    assert (bm.cached_hashes(10), bm.cache_version) == ((), 0)
    first = make_sequence("a", token_ids=[1, 2, 3, 4, 0])
    prefill(bm, first)
    v1 = bm.cache_version
    assert bm.cached_hashes(10) == tuple(reversed(block_hashes([1, 2, 3, 4, 0], 2)))
    assert bm.cached_hashes(1) == (block_hashes([1, 2, 3, 4], 2)[1],)  # the newest
    bm.free(first)
    assert bm.cache_version == v1  # freed blocks stay cached
    prefill(bm, make_sequence("b", token_ids=[5, 6, 7, 8, 0]))
    bm.allocate_slots(make_sequence("c", num_prompt_tokens=3), 3)  # evicts one of a's blocks
    assert bm.cache_version > v1 and len(bm.cached_hashes(10)) == 3


def test_a_prefix_is_shared_only_within_its_cache_partition() -> None:
    """Sequences share cached blocks only under the same cache root (a tenant's salt): the
    same prompt in another partition, or the shared one, misses (issue: one tenant must not
    learn from ``cached_tokens`` what another sent)."""
    from replicas.protocol import cache_root

    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(100, 113))  # 3 full blocks and one token
    first = make_sequence("a", token_ids=tokens)
    first.cache_root = cache_root("tenant-a")
    assert prefill(bm, first) == 0
    same = make_sequence("a2", token_ids=tokens)
    same.cache_root = cache_root("tenant-a")
    assert prefill(bm, same) == 12
    for other_root in (cache_root("tenant-b"), None):
        other = make_sequence(f"b{other_root}", token_ids=tokens)
        other.cache_root = other_root
        assert prefill(bm, other) == 0
    assert cache_root("tenant-a") == cache_root("tenant-a") != cache_root("tenant-b")
    assert cache_root(None) is None and cache_root("") is None
