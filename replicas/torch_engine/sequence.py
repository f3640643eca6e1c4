"""One request's state inside the engine: its tokens, its KV blocks, its timings.

A sequence's token list is prompt + output so far. ``num_computed_tokens`` of them have their
KV in the cache; the next step computes ``num_tokens - num_computed_tokens`` more (the rest of
a prompt chunk by chunk, then one token per decode step). Preemption by recompute sets
``num_computed_tokens`` back to 0 and frees the blocks; the prefix cache usually hands most of
them back when the sequence is scheduled again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replicas.engine.interface import FinishReason
from replicas.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from replicas.torch_engine.guide import Guide
    from replicas.torch_engine.lora import LoraAdapter


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_s: float = field(default_factory=time.time)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Block table: block_ids[i] holds the KV of tokens [i * block_size, (i + 1) * block_size).
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this sequence's full blocks, filled by the block manager as blocks fill.
    block_hashes: list[int] = field(default_factory=list)
    # The parent hash of its first block: its prefix-cache partition (protocol.cache_root).
    cache_root: int | None = None
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache, first schedule
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    guide: Guide | None = None  # the structured-output grammar's state, if any
    lora: LoraAdapter | None = None  # the adapter its tokens are computed with (None: base)
    # Fair scheduling (policies.py): the key whose token counter this sequence adds to (the router passes the tenant), its priority class (higher first) and weight.
    fair_key: str = ""
    priority: int = 0
    weight: float = 1.0
    arrival_order: int = 0  # set by the scheduler: the order of add() calls

    @classmethod
    def from_prompt(
        cls, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, **kwargs
    ) -> Sequence:
        assert prompt_token_ids, "an empty prompt must be rejected before it becomes a sequence"
        return cls(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            sampling=sampling,
            **kwargs,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
