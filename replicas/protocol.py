"""What the router and the model replicas both know: the one module each side imports from the
other, light enough for a router process (no torch, no engine).

- The sampling limits both sides check (the router refuses a request the engine would refuse,
  with OpenAI's 400, before it is queued).
- Block hashing of prompts (``hash_block_tokens``): the engine's prefix cache registers full
  KV blocks under these hashes, and the router's prefix-affinity routing hashes a prompt the
  same way to find the replica that holds it (``router/dispatch/prefix_affinity.py``).
- The keys of a replica's routing stats that carry its cached block hashes.
"""

from __future__ import annotations

# ---- sampling limits (names and ranges are vLLM's and OpenAI's) ----
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0
MAX_PRESENCE_FREQUENCY_PENALTY = 2.0
MAX_REPETITION_PENALTY = 1e9
MAX_N = 128  # OpenAI's limit; a deployment sets its own below it (router.api.max_n)

# ---- prefix blocks ----
# Stands in for the parent hash of a sequence's first block.
ROOT_HASH = 0x5EED_F00D_CAFE_BEEF


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block: the same in every process (a tuple of ints hashes
    without Python's per-process string salt), so a router and a replica agree."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, token_ids))


# the keys of a replica's routing stats (replicas/server.py, ModelReplica.record_routing_stats)
PUBLISHED_BLOCKS = "cached_block_hashes"
PUBLISHED_VERSION = "cached_version"
