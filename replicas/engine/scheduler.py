"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

The scheduler owns the waiting queue and the running list, and the life cycle of a sequence
from ``add`` to ``finish``; KV blocks are asked of the ``BlockManager``. Each step it hands the
engine a ``SchedulerOutput`` and, once the model ran, is told so by ``update_after_step``.

NOTE: the scheduling policy (vLLM v1 style).

There are no prefill and decode phases. A sequence needs ``num_uncomputed_tokens`` tokens in a
step: one while it decodes, the rest of its prompt while it prefills. One token budget
(``max_num_batched_tokens``) covers the whole batch.

1. Running first (decode-first). Running sequences, oldest first, each get
   ``min(num_uncomputed_tokens, budget left)`` tokens, so the work already started, mostly
   decodes, is served before anything new is admitted. A prompt longer than the budget left
   runs in chunks over several steps (chunked prefill); the model samples a token only for
   the chunk that reaches the end of the sequence (``is_sampling``).
2. Preemption by recompute. When the block manager has no block for a running sequence, the
   newest running sequence is preempted: its blocks are freed, its computed tokens forgotten,
   and it goes back to the FRONT of the waiting queue. Its prompt and output so far are
   recomputed when it is admitted again; the prefix cache usually hands most blocks back. If
   the sequence that needs the block is itself the newest, it is the one preempted. The oldest
   sequence is never preempted for a newer one, so it always makes progress.
3. FCFS admission. Only when nothing was preempted in this step (blocks are short), waiting
   sequences are admitted in arrival order while budget and ``max_num_seqs`` allow. Cached
   prefix blocks are taken first; if the rest does not fit, the attempt is undone and
   admission stops: no later, smaller request skips ahead of the one at the head.

Every step: the token budget is never exceeded, ``running`` never exceeds ``max_num_seqs``,
and a request is only ever running, waiting or finished, never lost.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from replicas.engine.block_manager import BlockManager
from replicas.engine.interface import FinishReason
from replicas.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")


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

    # --- queries ------------------------------------------------------------------------------

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
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

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

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request with ``ABORT``; ``None`` if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = _Budget(self.config.max_num_batched_tokens)
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        num_batched_tokens = self.config.max_num_batched_tokens - budget.num_left
        assert num_batched_tokens == sum(s.num_new_tokens for s in scheduled)
        return SchedulerOutput(scheduled, preempted, num_batched_tokens)

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

    # --- helpers ------------------------------------------------------------------------------

    def _schedule_running(
        self, budget: _Budget, scheduled: list[ScheduledSeq], preempted: list[Sequence]
    ) -> None:
        index = 0
        while index < len(self.running) and budget.num_left > 0:
            seq = self.running[index]
            assert seq.num_uncomputed_tokens > 0, "a running seq has nothing to compute"
            num_new_tokens = min(seq.num_uncomputed_tokens, budget.num_left)
            if not self._allocate_or_preempt(seq, num_new_tokens, preempted):
                break  # seq itself was preempted, and it was the last running one
            scheduled.append(self._scheduled(seq, num_new_tokens))
            budget.num_left -= num_new_tokens
            index += 1

    def _allocate_or_preempt(
        self, seq: Sequence, num_new_tokens: int, preempted: list[Sequence]
    ) -> bool:
        """Preempt the newest running seqs until ``seq`` gets its blocks; False if it went too."""
        while self.block_manager.allocate_slots(seq, num_new_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, budget: _Budget, scheduled: list[ScheduledSeq]) -> None:
        while self.waiting and budget.num_left > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_cached_tokens = self.block_manager.allocate_prefix(seq)
            num_new_tokens = min(seq.num_uncomputed_tokens, budget.num_left)
            if self.block_manager.allocate_slots(seq, num_new_tokens) is None:
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                return  # FCFS: nobody skips ahead of the head of the queue
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached_tokens
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = time.time()
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new_tokens))
            budget.num_left -= num_new_tokens

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks of the newest running seq, requeue it at the front."""
        assert self.running and self.running[-1] is seq, "only the newest seq is preempted"
        self.running.pop()
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    @staticmethod
    def _scheduled(seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        is_sampling = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        return ScheduledSeq(seq=seq, num_new_tokens=num_new_tokens, is_sampling=is_sampling)


@dataclass(slots=True)
class _Budget:
    """Tokens still free in this step's batch."""

    num_left: int
