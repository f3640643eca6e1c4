"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

The scheduler owns the waiting queue and the running list, and the life cycle of a sequence
from ``add`` to ``finish``; KV blocks are asked of the ``BlockManager``. Each step it hands the
engine a ``SchedulerOutput`` and, once the model ran, is told so by ``update_after_step``.

NOTE: the step (vLLM v1 style). There are no prefill and decode phases. A sequence needs
``num_uncomputed_tokens`` tokens in a step: one while it decodes, the rest of its prompt while it
prefills. One token budget (``max_num_batched_tokens``) covers the whole batch. A prompt longer
than the budget left runs in chunks over several steps (chunked prefill); the model samples a
token only for the chunk that reaches the end of the sequence (``is_sampling``). Who gets the
budget, in what order, and who is preempted first is the policy's (``policies.py``: ``fcfs``
and ``fair``, chosen once from ``SchedulerConfig.policy``); admitting a waiting sequence and
preemption by recompute (its blocks freed, its computed tokens forgotten, back to the FRONT of
the waiting queue) are the scheduler's, the same under every policy.

Every step: the token budget is never exceeded, ``running`` never exceeds ``max_num_seqs``,
and a request is only ever running, waiting or finished, never lost.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from replicas.engine.config import SchedulingPolicy
from replicas.engine.interface import FinishReason
from replicas.torch_engine.block_manager import BlockManager
from replicas.torch_engine.policies import Policy, make_policy
from replicas.torch_engine.sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "ScheduledSeq", "SchedulingPolicy"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    policy: SchedulingPolicy = SchedulingPolicy.FAIR
    # fair policy: the most prompt tokens in a step that also runs decodes (None: no cap)
    max_prompt_tokens_with_decodes: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_prompt_tokens_with_decodes is not None \
                and self.max_prompt_tokens_with_decodes < 1:
            raise ValueError("max_prompt_tokens_with_decodes must be at least 1, got "
                             f"{self.max_prompt_tokens_with_decodes}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # The chunk reaches the end of seq.token_ids: the model samples a token for this sequence.
    is_sampling: bool


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    num_batched_tokens: int
    # fair policy: this step runs one new arrival's first chunk and nothing else
    is_first_chunk_alone: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Picks the sequences of each engine step within the token budget and the KV blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self._arrivals = itertools.count()
        self.policy: Policy = make_policy(config.policy)  # chosen once, here

    # --- queries ------------------------------------------------------------------------------

    @property
    def counters(self) -> dict[str, float]:
        """fair policy: weighted tokens computed per fairness key (empty under fcfs)."""
        return self.policy.counters

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    # --- life cycle ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"request {seq.request_id!r} is already scheduled")
        assert not seq.block_ids and seq.num_computed_tokens == 0, "a new seq holds KV already"
        seq.status = SequenceStatus.WAITING
        seq.arrival_order = next(self._arrivals)
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)
        self.policy.on_add(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take ``seq`` out of the queues, free its blocks at once and mark it finished."""
        assert not seq.is_finished, f"request {seq.request_id!r} finished twice"
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        del self._seqs[seq.request_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_s = time.time()
        self.policy.on_finish(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request with ``ABORT``; ``None`` if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = Step(self.config.max_num_batched_tokens)
        is_first_chunk_alone = self.policy.schedule(self, step)
        num_batched_tokens = self.config.max_num_batched_tokens - step.num_left
        assert num_batched_tokens == sum(s.num_new_tokens for s in step.scheduled)
        return SchedulerOutput(step.scheduled, step.preempted, num_batched_tokens,
                               is_first_chunk_alone)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Account for the KV the model just computed; the engine appends sampled tokens after."""
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran; its blocks are already free
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                seq.num_prefill_chunks += 1
            seq.num_computed_tokens += item.num_new_tokens
            assert seq.num_computed_tokens <= seq.num_tokens
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)

    # --- for the policies -----------------------------------------------------------------------

    def admit(self, seq: Sequence, step: Step) -> int:
        """Start a waiting seq: cached prefix first, then its first chunk (its tokens are
        returned); 0 if its blocks do not fit."""
        num_cached_tokens = self.block_manager.allocate_prefix(seq)
        num_new_tokens = min(seq.num_uncomputed_tokens, step.num_left)
        if self.block_manager.allocate_slots(seq, num_new_tokens) is None:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            return 0
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached_tokens
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = time.time()
        self.waiting.remove(seq)  # the head under fcfs: O(1)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        step.add(seq, num_new_tokens)
        step.num_admitted += 1
        return num_new_tokens

    def allocate_or_preempt(self, seq: Sequence, num_new_tokens: int, step: Step) -> bool:
        """Preempt running seqs until ``seq`` gets its blocks; False if it went itself."""
        while self.block_manager.allocate_slots(seq, num_new_tokens) is None:
            victim = self._victim(seq, step)
            self._preempt(victim)
            step.preempted.append(victim)
            step.served.add(id(victim))
            if victim is seq:
                return False
        return True

    def _victim(self, seq: Sequence, step: Step) -> Sequence:
        """The policy's first class to preempt, then the newest running seq not served yet."""
        best: tuple[int, int] | None = None
        victim = seq
        for index, other in enumerate(self.running):
            if id(other) in step.served and other is not seq:
                continue
            rank = (self.policy.preemption_class(other), index)
            if best is None or rank > best:
                best, victim = rank, other
        return victim

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the seq's blocks and forget its KV; it waits again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


@dataclass(slots=True)
class Step:
    """One step being put together: tokens still free, what is scheduled, what was preempted."""

    num_left: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    served: set[int] = field(default_factory=set)  # ids of seqs scheduled or preempted
    num_admitted: int = 0

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        is_sampling = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        self.scheduled.append(ScheduledSeq(seq, num_new_tokens, is_sampling))
        self.served.add(id(seq))
        self.num_left -= num_new_tokens
