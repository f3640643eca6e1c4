"""Block hashing of prompts, the same in every process: the engine's prefix cache registers
full KV blocks under these hashes (``hash_block_tokens``), and the router's prefix-affinity
routing hashes a prompt the same way to find the replica that holds it
(``router/dispatch/prefix_affinity.py``); and the keys of a replica's routing stats that carry
its cached block hashes."""

from __future__ import annotations

import hashlib

# Stands in for the parent hash of a sequence's first block.
ROOT_HASH = 0x5EED_F00D_CAFE_BEEF


def cache_root(salt: str | None) -> int | None:
    """The parent hash of a sequence's first block in the prefix-cache partition ``salt``
    (vLLM's ``cache_salt``): sequences share cached blocks only within one partition, so one
    tenant cannot learn from ``cached_tokens`` what another sent. None: the shared partition.
    A digest of the salt, not ``hash()`` of it: a string's hash differs per process."""
    if not salt:
        return None
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return hash((ROOT_HASH, int.from_bytes(digest, "big")))


def adapter_salt(salt: str | None, adapter: str | None) -> str | None:
    """The prefix-cache partition of a request: its salt, and its LoRA adapter (an adapter's
    KV differs from the base model's); the engine and the replica choice key blocks alike."""
    if adapter is None:
        return salt
    return f"{salt or ''}\x00lora:{adapter}"


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block: the same in every process (a tuple of ints hashes
    without Python's per-process string salt), so a router and a replica agree."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, token_ids))


# the keys of a replica's routing stats (replicas/server.py, ModelReplica.record_routing_stats)
PUBLISHED_BLOCKS = "cached_block_hashes"
PUBLISHED_VERSION = "cached_version"
PUBLISHED_ADAPTERS = "loaded_adapters"  # the LoRA adapters a replica holds loaded
