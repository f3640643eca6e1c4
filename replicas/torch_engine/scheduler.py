"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

The scheduler owns the waiting queue and the running list, and the life cycle of a sequence
from ``add`` to ``finish``; KV blocks are asked of the ``BlockManager``. Each step it hands the
engine a ``SchedulerOutput`` and, once the model ran, is told so by ``update_after_step``.

NOTE: the scheduling policy (vLLM v1 style, fair by per-key token counters).

There are no prefill and decode phases. A sequence needs ``num_uncomputed_tokens`` tokens in a
step: one while it decodes, the rest of its prompt while it prefills. One token budget
(``max_num_batched_tokens``) covers the whole batch. A prompt longer than the budget left runs
in chunks over several steps (chunked prefill); the model samples a token only for the chunk
that reaches the end of the sequence (``is_sampling``).

``fcfs`` (arrival order, the policy before fairness):
1. Running first. Running sequences, oldest first, each get
   ``min(num_uncomputed_tokens, budget left)`` tokens, so the work already started, mostly
   decodes, is served before anything new is admitted.
2. Preemption by recompute. When the block manager has no block for a running sequence, the
   newest running sequence not yet served in this step is preempted: its blocks are freed, its
   computed tokens forgotten, and it goes back to the FRONT of the waiting queue. Its prompt
   and output so far are recomputed when it is admitted again; the prefix cache usually hands
   most blocks back. If the sequence that needs the block is itself the newest, it is the one
   preempted. The oldest sequence is never preempted for a newer one, so it always progresses.
3. FCFS admission. Only when nothing was preempted in this step (blocks are short), waiting
   sequences are admitted in arrival order while budget and ``max_num_seqs`` allow. Cached
   prefix blocks are taken first; if the rest does not fit, the attempt is undone and
   admission stops: no later, smaller request skips ahead of the one at the head.

``fair`` (the default; after VTC, Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024): every sequence carries a fairness key (the router passes the tenant), a priority
class and a weight. The scheduler keeps one counter per key: the tokens computed for the key's
sequences (prompt chunks and decodes alike; cached prefix tokens are free) divided by its
weight. A key that becomes active again (its first unfinished sequence arrives) is lifted to
the smallest counter among the active keys, so idling banks no credit.
1. Decodes first. Running sequences with one token to compute, oldest first: a decode is
   cheap, holds KV already, and its stream is what a client is watching.
2. Prefills by fairness. What budget is left goes to the prompt work, running chunked prefills
   and waiting sequences alike, ordered by (higher priority class, smaller counter, earlier
   arrival); each choice adds its tokens to its key's counter before the next is picked. So a
   new arrival of a key that has had less than its share runs its first chunk in the very next
   step, ahead of a flood of other keys' prompts, and the prefill budget is split by share.
   A waiting sequence is admitted only while nothing was preempted in this step and
   ``max_num_seqs`` allows; the first one whose blocks do not fit closes admission for the
   step (no smaller request skips ahead of it); running prefills still go on. A running
   prefill short of blocks in a step that admitted waits for the next step rather than
   preempting (admitting and preempting in one step would thrash).
3. An interactive arrival's first chunk alone. A waiting sequence of a key with nothing
   running (one caller, one request at a time) that no other key with work here is ahead of
   (a higher class or a smaller counter) runs its first chunk alone in the step: the decodes
   wait that one step, never two in a row. The same work is done either way (a mixed step
   costs about the prefill plus the decodes on a CPU), but the arrival's first token comes
   after its own prefill instead of after a mixed step; the decoding streams see the same gap.
   In a step that runs decodes, prompt work takes at most ``max_prompt_tokens_with_decodes``
   tokens when that is set (Sarathi-Serve's stall-free batching). Off by default: on the
   2-core CPU it shortened the worst steps but made more steps long, and the quiet tenant's
   median time to first token rose (README, "Scheduling inside the replica").
4. Preemption picks the lowest priority class first, then the newest running sequence not yet
   served in this step (as ``fcfs`` within a class); a preempted sequence waits with its key's
   counter and its first arrival, so it is re-admitted by the same order. Within the highest
   class the oldest running sequence is never preempted, so it always progresses.

Every step: the token budget is never exceeded, ``running`` never exceeds ``max_num_seqs``,
and a request is only ever running, waiting or finished, never lost.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from replicas.engine.config import SchedulingPolicy
from replicas.engine.interface import FinishReason
from replicas.torch_engine.block_manager import BlockManager
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
        # fair policy: weighted tokens computed per fairness key, and the unfinished sequences
        # per key (a key with none is inactive; its counter is lifted when it comes back)
        self.counters: dict[str, float] = {}
        self._num_active: Counter[str] = Counter()
        self._last_step_alone = False

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
        seq.arrival_order = next(self._arrivals)
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)
        if self.config.policy is SchedulingPolicy.FAIR:
            self._activate(seq.fair_key)

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
        if self.config.policy is SchedulingPolicy.FAIR:
            self._deactivate(seq.fair_key)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request with ``ABORT``; ``None`` if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens)
        if self.config.policy is SchedulingPolicy.FAIR:
            alone = None if self._last_step_alone else self._first_chunk_to_run_alone()
            num_new_tokens = self._admit(alone, step) if alone is not None else 0
            if num_new_tokens:
                self._charge(alone, num_new_tokens)  # type: ignore[arg-type]
            else:
                self._schedule_decodes(step)
                cap = self.config.max_prompt_tokens_with_decodes
                held = max(0, step.num_left - cap) if cap is not None and step.scheduled else 0
                step.num_left -= held  # prompt work shares a decode step up to the cap
                self._schedule_prompts_fairly(step)
                step.num_left += held
            self._last_step_alone = bool(num_new_tokens)
        else:
            self._schedule_running(step)
            if not step.preempted:
                self._schedule_waiting(step)
        num_batched_tokens = self.config.max_num_batched_tokens - step.num_left
        assert num_batched_tokens == sum(s.num_new_tokens for s in step.scheduled)
        return SchedulerOutput(step.scheduled, step.preempted, num_batched_tokens,
                               self._last_step_alone)

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

    # --- fcfs ---------------------------------------------------------------------------------

    def _schedule_running(self, step: _Step) -> None:
        index = 0
        while index < len(self.running) and step.num_left > 0:
            seq = self.running[index]
            assert seq.num_uncomputed_tokens > 0, "a running seq has nothing to compute"
            num_new_tokens = min(seq.num_uncomputed_tokens, step.num_left)
            if not self._allocate_or_preempt(seq, num_new_tokens, step):
                break  # seq itself was preempted, and it was the last running one
            step.add(seq, num_new_tokens)
            index += 1

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.num_left > 0 and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0], step):
                return  # FCFS: nobody skips ahead of the head of the queue

    # --- fair ---------------------------------------------------------------------------------

    def _schedule_decodes(self, step: _Step) -> None:
        for seq in list(self.running):  # a copy: preemption takes seqs out of it
            if step.num_left == 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted in this step, or still prefilling
            if self._allocate_or_preempt(seq, 1, step):
                step.add(seq, 1)
                self._charge(seq, 1)

    def _schedule_prompts_fairly(self, step: _Step) -> None:
        served = step.served
        heap = [self._fair_rank(seq) for seq in self.running
                if id(seq) not in served and seq.num_uncomputed_tokens > 1]
        if not step.preempted:
            heap += [self._fair_rank(seq) for seq in self.waiting]
        heapq.heapify(heap)
        is_admitting = not step.preempted
        while heap and step.num_left > 0:
            rank = heapq.heappop(heap)
            seq = rank[-1]
            if self.counters[seq.fair_key] > rank[1]:  # its key was served since: re-rank
                heapq.heappush(heap, self._fair_rank(seq))
                continue
            if seq.status is SequenceStatus.RUNNING:
                if id(seq) in served:
                    continue  # preempted for another seq in this step
                num_new_tokens = min(seq.num_uncomputed_tokens, step.num_left)
                if step.num_admitted and \
                        self.block_manager.allocate_slots(seq, num_new_tokens) is None:
                    is_admitting = False  # blocks ran short after admitting: no preemption
                    continue  # in the step that admitted; this seq goes on next step
                if self._allocate_or_preempt(seq, num_new_tokens, step):
                    step.add(seq, num_new_tokens)
                    self._charge(seq, num_new_tokens)
                is_admitting = is_admitting and not step.preempted
            elif is_admitting and id(seq) not in served \
                    and len(self.running) < self.config.max_num_seqs:
                num_new_tokens = self._admit(seq, step)
                if num_new_tokens:
                    self._charge(seq, num_new_tokens)
                else:
                    is_admitting = False  # nobody skips ahead of a seq that did not fit

    def _first_chunk_to_run_alone(self) -> Sequence | None:
        """A waiting seq of a key with nothing running (an interactive caller) that is owed the
        next prompt work: no other key with work here has a higher class or a smaller counter.
        Its first chunk runs alone in this step, the decodes wait one step (never two in a row):
        it reaches its first token in the time of its own prefill, not of a mixed step."""
        if not self.running or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        busy = {seq.fair_key for seq in self.running}
        best = min((seq for seq in self.waiting if seq.fair_key not in busy),
                   key=self._fair_rank, default=None)
        if best is None:
            return None
        mine = (-best.priority, self.counters[best.fair_key])
        for seq in itertools.chain(self.running, self.waiting):
            if seq.fair_key != best.fair_key and \
                    (-seq.priority, self.counters[seq.fair_key]) < mine:
                return None
        return best

    def _fair_rank(self, seq: Sequence) -> tuple[int, float, int, int, Sequence]:
        # the last field is never compared: (arrival order, id) are unique
        return (-seq.priority, self.counters[seq.fair_key], seq.arrival_order, id(seq), seq)

    def _charge(self, seq: Sequence, num_tokens: int) -> None:
        self.counters[seq.fair_key] += num_tokens / seq.weight

    def _activate(self, key: str) -> None:
        if self._num_active[key] == 0:
            floor = min((self.counters[k] for k in self._num_active), default=None)
            counter = self.counters.get(key, 0.0)
            self.counters[key] = counter if floor is None else max(counter, floor)
            self._prune_counters(floor)
        self._num_active[key] += 1

    def _deactivate(self, key: str) -> None:
        self._num_active[key] -= 1
        if self._num_active[key] == 0:
            del self._num_active[key]

    def _prune_counters(self, floor: float | None) -> None:
        """Forget inactive keys at or below the floor: their lift would restore exactly that."""
        if floor is None or len(self.counters) <= 2 * len(self._num_active) + 64:
            return
        for key in [k for k, c in self.counters.items() if k not in self._num_active and c <= floor]:
            del self.counters[key]

    # --- shared -------------------------------------------------------------------------------

    def _admit(self, seq: Sequence, step: _Step) -> int:
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

    def _allocate_or_preempt(self, seq: Sequence, num_new_tokens: int, step: _Step) -> bool:
        """Preempt running seqs until ``seq`` gets its blocks; False if it went itself."""
        while self.block_manager.allocate_slots(seq, num_new_tokens) is None:
            victim = self._victim(seq, step)
            self._preempt(victim)
            step.preempted.append(victim)
            step.served.add(id(victim))
            if victim is seq:
                return False
        return True

    def _victim(self, seq: Sequence, step: _Step) -> Sequence:
        """The lowest priority class (fair policy), then the newest running seq not served yet."""
        by_priority = self.config.policy is SchedulingPolicy.FAIR
        best: tuple[int, int] | None = None
        victim = seq
        for index, other in enumerate(self.running):
            if id(other) in step.served and other is not seq:
                continue
            rank = (-other.priority if by_priority else 0, index)
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
class _Step:
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
