"""Paged KV cache bookkeeping: which block holds which tokens, who holds which block.

The block manager owns the block table of every sequence (``seq.block_ids``), the reference
counts of the blocks, the LRU queue of free blocks and the prefix cache (``hash_to_block_id``).
It never touches a tensor: the model runner reads ``seq.block_ids`` and writes the KV there.

NOTE: prefix caching by chained block hashes.

A block holds the KV of ``block_size`` consecutive tokens. Once a block is FULL and its KV has
been COMPUTED, it is registered under the hash of ``(parent_hash, its tokens)``, where
``parent_hash`` is the hash of the block before it (for the first block: the sequence's
partition, ``seq.cache_root``, or ``ROOT_HASH`` in the shared one). The
chain makes a block's hash stand for the whole prefix up to its end, so two sequences sharing
a prompt prefix map the same blocks.

A hash is never trusted alone: each cached block keeps the exact inputs of its hash (its
parent's hash and its token tuple), and a lookup hits only when both are equal. A collision
therefore costs a cache miss, never wrong KV.

Blocks with ``ref_count == 0`` sit in an LRU free queue. A freed block goes to the END of the
queue and keeps its hash: it is "evictable cached" and can still be hit, which takes it out of
the queue again. Allocation takes from the FRONT; when the block taken carries a hash, the hash
entry is dropped (eviction). Sequences are freed tail block first, so the tail of a prefix,
the part least likely to be shared, is evicted before its head.

A prefix hit is capped at the full blocks within the first ``num_tokens - 1`` tokens: at least
one token is always computed, so the model produces the logits of the next token.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from replicas.protocol import ROOT_HASH, hash_block_tokens  # the router hashes prompts alike
from replicas.torch_engine.sequence import Sequence

__all__ = ["ROOT_HASH", "Block", "BlockManager", "hash_block_tokens"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Set only while the block is registered in the prefix cache; parent_hash and token_ids
    # are the exact inputs of block_hash, compared on every hit.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None

    def clear_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None


class BlockManager:
    """Allocates fixed-size KV blocks to sequences and shares cached prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 keys_token_kinds: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # An int4 engine computes prompt and generated tokens with different weights
        # (models/cpu_int4.py), so a block's KV depends on where its sequence's prompt ends:
        # blocks holding generated tokens are keyed with that boundary too.
        self.keys_token_kinds = keys_token_kinds
        self.blocks: list[Block] = [Block(block_id=i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (values unused).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}  # insertion order: oldest registered first
        self.cache_version = 0  # changes whenever a hash is registered or forgotten
        self._num_used_blocks = 0

    # --- counts -------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached or not: all of them can be allocated."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block_id)

    def cached_hashes(self, limit: int) -> tuple[int, ...]:
        """The hashes of the cached blocks, the most recently registered first, at most
        ``limit``: what a replica publishes for prefix-aware routing."""
        return tuple(itertools.islice(reversed(self.hash_to_block_id), limit))

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation ---------------------------------------------------------------------------

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix.

        Sets ``seq.block_ids``, ``seq.block_hashes`` and ``seq.num_computed_tokens``; returns
        the number of tokens served from the cache (a multiple of ``block_size``).
        """
        assert not seq.block_ids and not seq.block_hashes, "allocate_prefix on a seq with blocks"
        assert seq.num_computed_tokens == 0, "allocate_prefix on a partly computed seq"
        if not self.enable_prefix_caching:
            return 0
        hit_blocks, hit_hashes = self._find_cached_prefix(seq.token_ids, seq.num_prompt_tokens,
                                                          seq.cache_root)
        for block in hit_blocks:
            self._take_ref(block)
        seq.block_ids = [block.block_id for block in hit_blocks]
        seq.block_hashes = hit_hashes
        seq.num_computed_tokens = len(hit_blocks) * self.block_size
        return seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Returns the ids of the blocks added (possibly none), or ``None`` and allocates nothing
        when too few blocks are free.
        """
        assert num_new_tokens >= 0
        num_needed = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens)
        num_missing = num_needed - len(seq.block_ids)
        if num_missing <= 0:
            return []
        if num_missing > len(self.free_queue):
            return None
        new_block_ids = [self._allocate_block() for _ in range(num_missing)]
        seq.block_ids.extend(new_block_ids)
        return new_block_ids

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register every block that became full and computed up to ``num_computed_tokens``."""
        if not self.enable_prefix_caching:
            return
        assert num_computed_tokens <= seq.num_tokens, "computed tokens beyond the sequence"
        num_full_blocks = num_computed_tokens // self.block_size
        assert num_full_blocks <= len(seq.block_ids), "computed tokens beyond the block table"
        for index in range(len(seq.block_hashes), num_full_blocks):
            parent_hash = seq.block_hashes[index - 1] if index else seq.cache_root
            token_ids = self._block_token_ids(seq.token_ids, index, seq.num_prompt_tokens)
            block_hash = hash_block_tokens(parent_hash, token_ids)
            seq.block_hashes.append(block_hash)
            if block_hash in self.hash_to_block_id:
                # Same content already cached (or a collision): keep the existing entry; this
                # block stays unregistered and is plainly freed later.
                continue
            block = self.blocks[seq.block_ids[index]]
            assert block.block_hash is None, "a block registered twice"
            block.block_hash = block_hash
            block.parent_hash = parent_hash
            block.token_ids = token_ids
            self.hash_to_block_id[block_hash] = block.block_id
            self.cache_version += 1

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, tail first, so tail blocks are evicted first."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                self._num_used_blocks -= 1
        seq.block_ids = []
        seq.block_hashes = []

    # --- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent; tests call this after every step."""
        num_used = sum(1 for block in self.blocks if block.ref_count > 0)
        assert all(block.ref_count >= 0 for block in self.blocks), "negative ref_count"
        assert num_used == self._num_used_blocks, "used-block counter out of step"
        assert self.num_free_blocks + num_used == self.num_total_blocks, "free + used != total"
        free_ids = {block.block_id for block in self.blocks if block.ref_count == 0}
        assert set(self.free_queue) == free_ids, "free queue is not exactly the ref-0 blocks"
        for block_hash, block_id in self.hash_to_block_id.items():
            block = self.blocks[block_id]
            assert block.block_hash == block_hash, f"hash entry of block {block_id} is stale"
            assert block.token_ids is not None
            assert len([t for t in block.token_ids if t >= 0]) == self.block_size
            assert hash_block_tokens(block.parent_hash, block.token_ids) == block_hash
        num_hashed = sum(1 for block in self.blocks if block.block_hash is not None)
        assert num_hashed == len(self.hash_to_block_id), "a block carries an unregistered hash"

    # --- helpers ------------------------------------------------------------------------------

    def _find_cached_prefix(self, token_ids: list[int], num_prompt_tokens: int,
                            root: int | None = None) -> tuple[list[Block], list[int]]:
        # Full blocks within the first num_tokens - 1 tokens: one token is always computed.
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        hit_blocks: list[Block] = []
        hit_hashes: list[int] = []
        parent_hash = root
        for index in range(max_hit_blocks):
            block_tokens = self._block_token_ids(token_ids, index, num_prompt_tokens)
            block_hash = hash_block_tokens(parent_hash, block_tokens)
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != block_tokens or block.parent_hash != parent_hash:
                break  # a hash collision: the cached block holds other tokens
            hit_blocks.append(block)
            hit_hashes.append(block_hash)
            parent_hash = block_hash
        return hit_blocks, hit_hashes

    def _block_token_ids(self, token_ids: list[int], index: int,
                         num_prompt_tokens: int) -> tuple[int, ...]:
        """The block's tokens; with ``keys_token_kinds``, a block holding generated tokens ends
        with a marker (negative: no token id) saying how many of its tokens are prompt."""
        start = index * self.block_size
        tokens = tuple(token_ids[start : start + self.block_size])
        num_prompt_in_block = min(max(num_prompt_tokens - start, 0), self.block_size)
        if self.keys_token_kinds and num_prompt_in_block < self.block_size:
            return (*tokens, -1 - num_prompt_in_block)
        return tokens

    def _take_ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_queue[block.block_id]  # a cached block hit while free
            self._num_used_blocks += 1
        block.ref_count += 1

    def _allocate_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} in the free queue while referenced"
        if block.block_hash is not None:
            evicted_id = self.hash_to_block_id.pop(block.block_hash)
            assert evicted_id == block_id, "hash entry pointed at another block"
            block.clear_hash()
            self.cache_version += 1
        block.ref_count = 1
        self._num_used_blocks += 1
        return block_id
