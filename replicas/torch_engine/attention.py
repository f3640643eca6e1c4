"""Paged attention on torch: writes a step's keys/values into the block cache and attends.

NOTE: the KV cache of one layer is a pair of tensors shaped
``(num_blocks, block_size, num_kv_heads, head_dim)``; a sequence's block table lists which
blocks hold its tokens in order. A step's flat batch puts every decode token first (one per
sequence) and then each prefill chunk. Decodes are attended in one padded call: the block
tables are gathered into ``(batch, max_len, ...)`` keys with a mask of each sequence's length,
and grouped-query attention is done without copying K/V per query head by viewing the queries
as ``(batch, num_kv_heads, group, head_dim)``. A prefill chunk that starts at position 0 attends
to its own fresh keys with ``is_causal``; one that continues a prefix (earlier chunks, or blocks
from the prefix cache) gathers its context from the cache with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    query_start: int  # first row of this chunk in the flat batch
    query_end: int
    num_context_tokens: int  # tokens with KV after this step (cached prefix + chunk)
    block_ids: torch.Tensor  # (num_blocks_of_seq,) long
    mask: torch.Tensor | None  # (chunk_len, num_context_tokens) bool; None when fresh & causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) long: block_id * block_size + offset
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # (num_decodes, max_blocks) long, padded with 0
    decode_mask: torch.Tensor | None  # (num_decodes, 1, 1, max_blocks * block_size) bool
    prefills: list[PrefillSpan]


@dataclass(slots=True)
class KernelMetadata:
    """A step for the CPU kernels (``torch.ops.fairserve.paged_attention``): every token carries
    its position and its sequence; a token at position p attends to its sequence's keys up to p
    (within the sliding window), whether it is a decode or part of a prefill chunk."""

    positions: torch.Tensor  # (num_tokens,) long
    slot_mapping: torch.Tensor  # (num_tokens,) long: block_id * block_size + offset
    token_seq: torch.Tensor  # (num_tokens,) long: the token's row in block_tables
    block_tables: torch.Tensor  # (num_seqs, max_blocks) long, padded with 0
    # rows [0, num_generated) hold generated tokens (decodes, resumed or recomputed output),
    # the rest prompt tokens: int4 engines compute the two with different weights
    num_generated: int = 0


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta)
    for span in meta.prefills:
        out[span.query_start : span.query_end] = _prefill_attention(q, k, v, k_cache, v_cache, span)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    flat_tables = meta.decode_block_tables.flatten()
    # index_select copies whole blocks (advanced indexing is ~20x slower on CPU):
    # (batch * max_blocks, block_size, kv_heads, head_dim) -> (batch, kv_heads, max_len, head_dim)
    keys = k_cache.index_select(0, flat_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, flat_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    grouped_q = q.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=meta.decode_mask)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
) -> torch.Tensor:
    rows = slice(span.query_start, span.query_end)
    query = q[rows].transpose(0, 1)  # (num_heads, chunk_len, head_dim)
    if span.mask is None:
        keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
    else:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        n = span.num_context_tokens
        keys = k_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
        values = v_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=span.mask, enable_gqa=True
        )
    return out.transpose(0, 1)
