"""The scheduling policies, one class each: ``FcfsPolicy`` (arrival order) and ``FairPolicy``
(per-key token counters, the default). The ``Scheduler`` builds one from its config once and
calls it each step; the policy decides which sequences get the step's token budget, in what
order, and which running sequence is preempted first. The queues, the KV blocks and the life
cycle of a sequence stay the scheduler's (``scheduler.py``).

NOTE: the policies (vLLM v1 style, fair by per-key token counters).

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
class and a weight. The policy keeps one counter per key: the tokens computed for the key's
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
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from typing import TYPE_CHECKING

from replicas.engine.config import SchedulingPolicy
from replicas.torch_engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from replicas.torch_engine.scheduler import Scheduler, Step

__all__ = ["FairPolicy", "FcfsPolicy", "Policy", "make_policy"]


class Policy(ABC):
    """How a step's token budget is handed out; the scheduler's queues are its input."""

    def __init__(self) -> None:
        # fair: weighted tokens computed per fairness key (empty under fcfs)
        self.counters: dict[str, float] = {}

    @abstractmethod
    def on_add(self, seq: Sequence) -> None:
        """``seq`` was added to the waiting queue."""

    @abstractmethod
    def on_finish(self, seq: Sequence) -> None:
        """``seq`` left the queues for good."""

    @abstractmethod
    def schedule(self, scheduler: Scheduler, step: Step) -> bool:
        """Fill ``step`` from the scheduler's queues; True if it runs one arrival's first chunk
        and nothing else."""

    @abstractmethod
    def preemption_class(self, seq: Sequence) -> int:
        """Higher classes are preempted first; within one, the newest running sequence."""


class FcfsPolicy(Policy):
    """Arrival order: running sequences first, then the waiting queue's head, never skipped."""

    def schedule(self, scheduler: Scheduler, step: Step) -> bool:
        self._schedule_running(scheduler, step)
        if not step.preempted:
            self._schedule_waiting(scheduler, step)
        return False

    def on_add(self, seq: Sequence) -> None:
        pass  # arrival order is the queue's own

    def on_finish(self, seq: Sequence) -> None:
        pass

    def preemption_class(self, seq: Sequence) -> int:
        return 0

    @staticmethod
    def _schedule_running(scheduler: Scheduler, step: Step) -> None:
        running = scheduler.running
        index = 0
        while index < len(running) and step.num_left > 0:
            seq = running[index]
            assert seq.num_uncomputed_tokens > 0, "a running seq has nothing to compute"
            num_new_tokens = min(seq.num_uncomputed_tokens, step.num_left)
            if not scheduler.allocate_or_preempt(seq, num_new_tokens, step):
                break  # seq itself was preempted, and it was the last running one
            step.add(seq, num_new_tokens)
            index += 1

    @staticmethod
    def _schedule_waiting(scheduler: Scheduler, step: Step) -> None:
        max_num_seqs = scheduler.config.max_num_seqs
        while scheduler.waiting and step.num_left > 0 and len(scheduler.running) < max_num_seqs:
            if not scheduler.admit(scheduler.waiting[0], step):
                return  # FCFS: nobody skips ahead of the head of the queue


class FairPolicy(Policy):
    """Decodes first, then prompt work by (priority class, weighted tokens served, arrival)."""

    def __init__(self) -> None:
        super().__init__()
        # the unfinished sequences per key (a key with none is inactive; its counter is lifted
        # when it comes back)
        self._num_active: Counter[str] = Counter()
        self._last_step_alone = False

    def on_add(self, seq: Sequence) -> None:
        key = seq.fair_key
        if self._num_active[key] == 0:
            floor = min((self.counters[k] for k in self._num_active), default=None)
            counter = self.counters.get(key, 0.0)
            self.counters[key] = counter if floor is None else max(counter, floor)
            self._prune_counters(floor)
        self._num_active[key] += 1

    def on_finish(self, seq: Sequence) -> None:
        key = seq.fair_key
        self._num_active[key] -= 1
        if self._num_active[key] == 0:
            del self._num_active[key]

    def preemption_class(self, seq: Sequence) -> int:
        return -seq.priority

    def schedule(self, scheduler: Scheduler, step: Step) -> bool:
        alone = None if self._last_step_alone else self._first_chunk_to_run_alone(scheduler)
        num_new_tokens = scheduler.admit(alone, step) if alone is not None else 0
        if alone is not None and num_new_tokens:
            self._charge(alone, num_new_tokens)
        else:
            self._schedule_decodes(scheduler, step)
            cap = scheduler.config.max_prompt_tokens_with_decodes
            held = max(0, step.num_left - cap) if cap is not None and step.scheduled else 0
            step.num_left -= held  # prompt work shares a decode step up to the cap
            self._schedule_prompts(scheduler, step)
            step.num_left += held
        self._last_step_alone = bool(num_new_tokens)
        return self._last_step_alone

    def _schedule_decodes(self, scheduler: Scheduler, step: Step) -> None:
        for seq in list(scheduler.running):  # a copy: preemption takes seqs out of it
            if step.num_left == 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted in this step, or still prefilling
            if scheduler.allocate_or_preempt(seq, 1, step):
                step.add(seq, 1)
                self._charge(seq, 1)

    def _schedule_prompts(self, scheduler: Scheduler, step: Step) -> None:
        served = step.served
        heap = [self._rank(seq) for seq in scheduler.running
                if id(seq) not in served and seq.num_uncomputed_tokens > 1]
        if not step.preempted:
            heap += [self._rank(seq) for seq in scheduler.waiting]
        heapq.heapify(heap)
        is_admitting = not step.preempted
        while heap and step.num_left > 0:
            rank = heapq.heappop(heap)
            seq = rank[-1]
            if self.counters[seq.fair_key] > rank[1]:  # its key was served since: re-rank
                heapq.heappush(heap, self._rank(seq))
                continue
            if seq.status is SequenceStatus.RUNNING:
                if id(seq) in served:
                    continue  # preempted for another seq in this step
                num_new_tokens = min(seq.num_uncomputed_tokens, step.num_left)
                if step.num_admitted and \
                        scheduler.block_manager.allocate_slots(seq, num_new_tokens) is None:
                    is_admitting = False  # blocks ran short after admitting: no preemption
                    continue  # in the step that admitted; this seq goes on next step
                if scheduler.allocate_or_preempt(seq, num_new_tokens, step):
                    step.add(seq, num_new_tokens)
                    self._charge(seq, num_new_tokens)
                is_admitting = is_admitting and not step.preempted
            elif is_admitting and id(seq) not in served \
                    and len(scheduler.running) < scheduler.config.max_num_seqs:
                num_new_tokens = scheduler.admit(seq, step)
                if num_new_tokens:
                    self._charge(seq, num_new_tokens)
                else:
                    is_admitting = False  # nobody skips ahead of a seq that did not fit

    def _first_chunk_to_run_alone(self, scheduler: Scheduler) -> Sequence | None:
        """A waiting seq of a key with nothing running (an interactive caller) that is owed the
        next prompt work: no other key with work here has a higher class or a smaller counter.
        Its first chunk runs alone in this step, the decodes wait one step (never two in a row):
        it reaches its first token in the time of its own prefill, not of a mixed step."""
        running, waiting = scheduler.running, scheduler.waiting
        if not running or not waiting or len(running) >= scheduler.config.max_num_seqs:
            return None
        busy = {seq.fair_key for seq in running}
        best = min((seq for seq in waiting if seq.fair_key not in busy),
                   key=self._rank, default=None)
        if best is None:
            return None
        mine = (-best.priority, self.counters[best.fair_key])
        for seq in itertools.chain(running, waiting):
            if seq.fair_key != best.fair_key and \
                    (-seq.priority, self.counters[seq.fair_key]) < mine:
                return None
        return best

    def _rank(self, seq: Sequence) -> tuple[int, float, int, int, Sequence]:
        # the last field is never compared: (arrival order, id) are unique
        return (-seq.priority, self.counters[seq.fair_key], seq.arrival_order, id(seq), seq)

    def _charge(self, seq: Sequence, num_tokens: int) -> None:
        self.counters[seq.fair_key] += num_tokens / seq.weight

    def _prune_counters(self, floor: float | None) -> None:
        """Forget inactive keys at or below the floor: their lift would restore exactly that."""
        if floor is None or len(self.counters) <= 2 * len(self._num_active) + 64:
            return
        for key in [k for k, c in self.counters.items() if k not in self._num_active and c <= floor]:
            del self.counters[key]


def make_policy(policy: SchedulingPolicy) -> Policy:
    if policy is SchedulingPolicy.FAIR:
        return FairPolicy()
    return FcfsPolicy()
