"""Runs the model for one scheduled step: builds the flat batch, owns the KV cache tensors.

The runner turns a ``SchedulerOutput`` into input ids, positions, cache slots and attention
metadata, runs the model, and returns logits only for the rows that sample (the last token of
each sequence whose chunk reached the end of its tokens).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from replicas.torch_engine.attention import AttentionMetadata, KernelMetadata, PrefillSpan
from replicas.torch_engine.lora import LoraBatch, LoraStacks
from replicas.torch_engine.models.llama import LlamaForCausalLM
from replicas.torch_engine.models.model_config import ModelConfig
from replicas.torch_engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True, slots=True)
class CacheShape:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        # keys and values, every layer
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    meta: AttentionMetadata | KernelMetadata
    sample_rows: torch.Tensor  # (num_sampling,) rows of the flat batch, in `scheduled` order
    lora: LoraBatch | None = None  # the rows of LoRA adapters; None: all the base model's


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: CacheShape,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.sliding_window = model.cfg.sliding_window
        shape = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim)
        # One (key, value) pair per layer, each (num_blocks, block_size, num_kv_heads, head_dim).
        kv = zeroed((cache.num_layers, 2, *shape), dtype, device)
        self.kv_caches = [(kv[layer, 0], kv[layer, 1]) for layer in range(cache.num_layers)]
        self.lora_stacks = LoraStacks()  # the step's adapters, stacked (lora.py)
        self.uses_lora = False  # set once a request names an adapter: until then no row has one

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns float32 logits (num_sampling, vocab) in ``scheduled`` order."""
        batch = self._prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                            batch.lora)
        return self.model.compute_logits(hidden[batch.sample_rows]).float()

    def _prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        decodes = [s for s in scheduled if _is_decode(s)]
        prefills = [s for s in scheduled if not _is_decode(s)]
        if self.model.uses_cpu_kernels:
            return self._prepare_for_kernels(decodes + prefills, scheduled)
        bs = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_of: dict[int, int] = {}
        adapters = []
        for s in decodes:
            pos = s.seq.num_computed_tokens
            row_of[id(s)] = len(input_ids)
            if self.uses_lora:
                adapters.append(s.seq.lora)
            input_ids.append(s.seq.token_ids[pos])
            positions.append(pos)
            slots.append(s.seq.block_ids[pos // bs] * bs + pos % bs)
        spans = []
        for s in prefills:
            start, end = s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens
            spans.append(self._prefill_span(s, len(input_ids)))
            if self.uses_lora:
                adapters.extend([s.seq.lora] * (end - start))
            input_ids.extend(s.seq.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = s.seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            row_of[id(s)] = len(input_ids) - 1
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=len(decodes),
            decode_block_tables=None,
            decode_mask=None,
            prefills=spans,
        )
        if decodes:
            meta.decode_block_tables, meta.decode_mask = self._decode_tables(decodes)
        sample_rows = [row_of[id(s)] for s in scheduled if s.is_sampling]
        return StepBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            meta=meta,
            sample_rows=self._tensor(sample_rows),
            lora=LoraBatch.of_rows(adapters, self.device, self.lora_stacks) if adapters else None,
        )

    def _prepare_for_kernels(
        self, ordered: list[ScheduledSeq], scheduled: list[ScheduledSeq]
    ) -> StepBatch:
        """Rows of generated tokens (position >= the sequence's prompt length: decodes, and the
        output part of a resumed or recomputed sequence) first, then prompt tokens; the kernels
        take any row order, and an int4 engine computes the two parts with different weights."""
        bs = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        token_seq: list[int] = []
        last_position = {id(s): s.seq.num_computed_tokens + s.num_new_tokens - 1 for s in ordered}
        row_of: dict[int, int] = {}
        for generated in (True, False):
            if not generated:
                num_generated = len(input_ids)
            for index, s in enumerate(ordered):
                start, end = s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens
                cut = min(max(s.seq.num_prompt_tokens, start), end)
                lo, hi = (cut, end) if generated else (start, cut)
                if lo == hi:
                    continue
                input_ids.extend(s.seq.token_ids[lo:hi])
                positions.extend(range(lo, hi))
                token_seq.extend([index] * (hi - lo))
                if lo <= last_position[id(s)] < hi:
                    row_of[id(s)] = len(input_ids) - 1
        slots = [ordered[i].seq.block_ids[p // bs] * bs + p % bs
                 for i, p in zip(token_seq, positions, strict=True)]
        num_blocks = [-(-(s.seq.num_computed_tokens + s.num_new_tokens) // bs) for s in ordered]
        width = max(num_blocks)
        tables = [s.seq.block_ids[:n] + [0] * (width - n) for s, n in zip(ordered, num_blocks,
                                                                         strict=True)]
        positions_t = self._tensor(positions)
        meta = KernelMetadata(positions_t, self._tensor(slots), self._tensor(token_seq),
                              self._tensor(tables), num_generated)
        sample_rows = [row_of[id(s)] for s in scheduled if s.is_sampling]
        lora = LoraBatch.of_rows([ordered[i].seq.lora for i in token_seq], self.device,
                                 self.lora_stacks) if self.uses_lora else None
        return StepBatch(self._tensor(input_ids), positions_t, meta, self._tensor(sample_rows),
                         lora)

    def _decode_tables(self, decodes: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        max_blocks = max(len(s.seq.block_ids) for s in decodes)
        tables = [s.seq.block_ids + [0] * (max_blocks - len(s.seq.block_ids)) for s in decodes]
        # After this step each decode attends to its num_computed + 1 tokens.
        lengths = self._tensor([s.seq.num_computed_tokens + 1 for s in decodes])
        keys = torch.arange(max_blocks * self.cache.block_size, device=self.device)
        mask = keys[None, :] < lengths[:, None]  # (num_decodes, max_len)
        if self.sliding_window is not None:
            mask &= keys[None, :] > (lengths[:, None] - 1 - self.sliding_window)
        return self._tensor(tables), mask[:, None, None, :]

    def _prefill_span(self, s: ScheduledSeq, query_start: int) -> PrefillSpan:
        start = s.seq.num_computed_tokens
        n = s.num_new_tokens
        context = start + n
        window = self.sliding_window
        mask = None
        if start > 0 or (window is not None and window < n):
            query_pos = torch.arange(start, context, device=self.device)[:, None]
            key_pos = torch.arange(context, device=self.device)[None, :]
            mask = key_pos <= query_pos  # (n, context)
            if window is not None:
                mask &= key_pos > query_pos - window
        num_blocks = -(-context // self.cache.block_size)
        return PrefillSpan(
            query_start=query_start,
            query_end=query_start + n,
            num_context_tokens=context,
            block_ids=self._tensor(s.seq.block_ids[:num_blocks]),
            mask=mask,
        )

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU one whose pages the kernel zeroes as they are first touched.

    NOTE: ``torch.zeros`` writes every byte up front: for the default 1 GiB KV cache that is
    1-2 s of a replica's start. numpy's ``zeros`` is ``calloc``, which for an allocation this
    size maps fresh (already zero) pages and writes nothing, so only blocks in use ever cost.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8))
    return raw.view(dtype).view(shape)


def _is_decode(s: ScheduledSeq) -> bool:
    """One new token on top of computed KV: a decode (or a one-token recompute tail)."""
    return s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0
