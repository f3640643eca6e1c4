"""Scheduler: chunked prefill, decode mixing, preemption, FCFS and fair admission, aborts.

A ``Simulation`` plays the engine without a model: it schedules, "computes" KV into a fake
cache (checking that every token a sequence attends to holds the right token), appends a fake
sampled token and finishes sequences at ``max_tokens``, checking the block manager's
invariants, reference counts, the token budget and ``max_num_seqs`` after every step.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.engine.interface import FinishReason
from replicas.torch_engine.block_manager import BlockManager
from replicas.torch_engine.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulingPolicy,
)
from replicas.torch_engine.sequence import Sequence, SequenceStatus
from tests.replicas.torch_engine.factories import make_sequence

MAX_STEPS = 5_000
FAIR, FCFS = SchedulingPolicy.FAIR, SchedulingPolicy.FCFS
BOTH_POLICIES = pytest.mark.parametrize("policy", [FAIR, FCFS])


@dataclass
class Simulation:
    scheduler: Scheduler
    step: int = 0
    num_finishes: Counter[str] = field(default_factory=Counter)
    # Fake KV cache: the token whose KV each slot of each block holds.
    kv: defaultdict[int, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    outputs: list[SchedulerOutput] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool = True,
        policy: SchedulingPolicy = FCFS,
        max_prompt_tokens_with_decodes: int | None = None,
    ) -> Simulation:
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, policy,
                                 max_prompt_tokens_with_decodes)
        return cls(Scheduler(config, bm))

    @property
    def bm(self) -> BlockManager:
        return self.scheduler.block_manager

    def add(self, seq: Sequence) -> Sequence:
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.num_finishes[request_id] += 1
            assert seq.block_ids == [] and seq.finish_reason is FinishReason.ABORT
        self.check_state()
        return seq

    def run_step(self) -> SchedulerOutput:
        running_before = list(self.scheduler.running)
        waiting_before = list(self.scheduler.waiting)
        decodes_before = {id(s) for s in running_before if s.num_uncomputed_tokens == 1}
        output = self.scheduler.schedule()
        self.check_output(output, running_before, waiting_before, decodes_before)
        self.check_state()
        self.fake_model_step(output)
        self.scheduler.update_after_step(output)
        for item in output.scheduled:
            if item.is_sampling:
                self.sample(item.seq)
        self.check_state()
        self.outputs.append(output)
        self.step += 1
        return output

    def run_until_done(self) -> None:
        while self.scheduler.has_unfinished:
            assert self.step < MAX_STEPS, "the scheduler stopped making progress"
            self.run_step()
        assert self.bm.num_free_blocks == self.bm.num_total_blocks

    def sample(self, seq: Sequence) -> None:
        seq.append_token(self.step % 100)
        if seq.first_token_s is None:
            seq.first_token_s = time.time()
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            self.scheduler.finish(seq, FinishReason.LENGTH)
            self.num_finishes[seq.request_id] += 1

    def fake_model_step(self, output: SchedulerOutput) -> None:
        block_size = self.bm.block_size
        for item in output.scheduled:
            seq = item.seq
            # Attention reads every computed token: each slot must hold that very token.
            for pos in range(seq.num_computed_tokens):
                block_id = seq.block_ids[pos // block_size]
                assert self.kv[block_id].get(pos % block_size) == seq.token_ids[pos], (
                    f"{seq.request_id}: wrong KV at position {pos}"
                )
            end = seq.num_computed_tokens + item.num_new_tokens
            for pos in range(seq.num_computed_tokens, end):
                block = self.bm.blocks[seq.block_ids[pos // block_size]]
                assert block.ref_count == 1, "KV written into a shared block"
                assert block.block_hash is None, "KV written into a cached block"
                self.kv[block.block_id][pos % block_size] = seq.token_ids[pos]

    def check_output(
        self,
        output: SchedulerOutput,
        running_before: list[Sequence],
        waiting_before: list[Sequence],
        decodes_before: set[int],
    ) -> None:
        config = self.scheduler.config
        num_tokens = sum(item.num_new_tokens for item in output.scheduled)
        assert output.num_batched_tokens == num_tokens <= config.max_num_batched_tokens
        assert self.scheduler.num_running <= config.max_num_seqs
        seqs = [item.seq for item in output.scheduled]
        assert len({id(seq) for seq in seqs}) == len(seqs), "a seq scheduled twice"
        for item in output.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens >= 1
            end = seq.num_computed_tokens + item.num_new_tokens
            assert end <= seq.num_tokens
            assert item.is_sampling == (end == seq.num_tokens)
            assert len(seq.block_ids) * self.bm.block_size >= end
        assert not {id(seq) for seq in output.preempted} & {id(seq) for seq in seqs}
        for seq in output.preempted:
            assert any(seq is r for r in running_before), "a victim that was not running"
            assert seq.status is SequenceStatus.WAITING and seq.block_ids == []
            assert seq.num_computed_tokens == 0
        admitted = [seq for seq in seqs if any(seq is w for w in waiting_before)]
        assert not (admitted and output.preempted), "admission in a step that preempted"
        if config.policy is FCFS:
            # Victims are the newest running seqs; admission is in arrival order.
            assert output.preempted == running_before[::-1][: len(output.preempted)]
            assert admitted == waiting_before[: len(admitted)]
            return
        # Fair: victims come from the lowest priority class among the seqs left unserved.
        served = {id(seq) for seq in seqs + output.preempted}
        unserved = [seq for seq in running_before if id(seq) not in served]
        for victim in output.preempted:
            assert all(seq.priority >= victim.priority for seq in unserved)
        if output.is_first_chunk_alone:
            # One interactive arrival's first chunk alone, never two such steps in a row.
            assert len(seqs) == 1 and admitted == seqs and not output.preempted
            assert not any(r.fair_key == seqs[0].fair_key for r in running_before)
            assert not (self.outputs and self.outputs[-1].is_first_chunk_alone)
            return
        # Decodes first: a decode left out means the budget went to decodes only.
        if any(id(seq) in decodes_before for seq in unserved):
            assert all(id(seq) in decodes_before for seq in seqs)
        # Prompt work in a step with decodes stays within its cap.
        cap = config.max_prompt_tokens_with_decodes
        if cap is not None and any(id(item.seq) in decodes_before for item in output.scheduled):
            assert sum(item.num_new_tokens for item in output.scheduled
                       if id(item.seq) not in decodes_before) <= cap
        # Admission: a higher priority class first; one key's seqs in arrival order.
        not_admitted = [w for w in waiting_before if not any(w is a for a in admitted)]
        for a in admitted:
            for w in not_admitted:
                assert a.priority >= w.priority, "a lower class admitted before a higher one"
                if a.fair_key == w.fair_key and a.priority == w.priority:
                    assert a.arrival_order < w.arrival_order, "a key's later seq went first"

    def check_state(self) -> None:
        self.bm.check_invariants()
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        refs: Counter[int] = Counter()
        for seq in live:
            assert not seq.is_finished
            assert len(set(seq.block_ids)) == len(seq.block_ids)
            assert len(seq.block_ids) >= self.bm.num_blocks_needed(seq.num_computed_tokens)
            assert len(seq.block_ids) <= self.bm.num_blocks_needed(seq.num_tokens)
            refs.update(seq.block_ids)
        for block in self.bm.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref_count"


def test_config_rejects_non_positive_limits() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0, max_num_seqs=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=0)


@BOTH_POLICIES
def test_one_request_prefills_decodes_and_finishes(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=8, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    seq = sim.add(make_sequence("a", num_prompt_tokens=10, max_tokens=5))
    assert (sim.scheduler.num_waiting, sim.scheduler.has_unfinished) == (1, True)
    first = sim.run_step()
    assert [(s.num_new_tokens, s.is_sampling) for s in first.scheduled] == [(10, True)]
    sim.run_until_done()
    assert seq.num_output_tokens == 5 and seq.finish_reason is FinishReason.LENGTH
    assert seq.status is SequenceStatus.FINISHED and seq.finished_s is not None
    assert seq.first_scheduled_s is not None and seq.num_cached_tokens == 0
    assert seq.num_prefill_chunks == 1 and seq.num_preemptions == 0
    assert [o.num_batched_tokens for o in sim.outputs] == [10, 1, 1, 1, 1]
    assert sim.scheduler.get("a") is None and not sim.scheduler.has_unfinished


@BOTH_POLICIES
def test_long_prompt_is_chunked(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    seq = sim.add(make_sequence("long", num_prompt_tokens=100, max_tokens=2))
    chunks = [sim.run_step().scheduled[0] for _ in range(4)]
    assert [c.num_new_tokens for c in chunks] == [32, 32, 32, 4]
    assert [c.is_sampling for c in chunks] == [False, False, False, True]
    assert seq.status is SequenceStatus.RUNNING and seq.num_prefill_chunks == 4
    sim.run_until_done()
    assert seq.num_prefill_chunks == 4


@BOTH_POLICIES
def test_chunked_prefill_mixes_with_decodes_of_running_seqs(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    short = [sim.add(make_sequence(f"s{i}", num_prompt_tokens=4, max_tokens=20)) for i in range(2)]
    sim.run_step()  # both prefill and sample their first token
    long = sim.add(make_sequence("long", num_prompt_tokens=100, max_tokens=3))
    long_chunks: list[int] = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        output = sim.run_step()
        by_id = {item.seq.request_id: item for item in output.scheduled}
        assert [by_id[s.request_id].num_new_tokens for s in short] == [1, 1]  # decodes first
        long_chunks.append(by_id["long"].num_new_tokens)
        assert output.num_batched_tokens == min(32, 2 + long_chunks[-1])
    assert long_chunks == [30, 30, 30, 10]
    assert long.num_prefill_chunks == 4
    sim.run_until_done()
    assert [s.num_output_tokens for s in short + [long]] == [20, 20, 3]


@BOTH_POLICIES
def test_budget_and_max_num_seqs_limit_admission(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=64, block_size=4, max_num_batched_tokens=20, max_num_seqs=3,
                            policy=policy)
    for i in range(5):
        sim.add(make_sequence(f"r{i}", num_prompt_tokens=8, max_tokens=4))
    output = sim.run_step()
    # 8 + 8 + 4 tokens: the third gets a partial chunk and keeps running.
    assert [(s.seq.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("r0", 8),
        ("r1", 8),
        ("r2", 4),
    ]
    assert (sim.scheduler.num_running, sim.scheduler.num_waiting) == (3, 2)
    output = sim.run_step()
    assert [(s.seq.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 4),
    ]  # max_num_seqs: nobody else is admitted
    sim.run_until_done()


@BOTH_POLICIES
def test_waiting_head_that_does_not_fit_blocks_later_requests(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                            policy=policy)
    sim.add(make_sequence("a", num_prompt_tokens=11, max_tokens=2))
    sim.run_step()  # a holds 3 of the 4 blocks
    big = sim.add(make_sequence("big", num_prompt_tokens=8, max_tokens=1))
    small = sim.add(make_sequence("small", num_prompt_tokens=2, max_tokens=1))
    output = sim.run_step()
    assert [s.seq.request_id for s in output.scheduled] == ["a"]  # small does not skip ahead
    assert big.status is small.status is SequenceStatus.WAITING
    assert big.block_ids == [] and big.num_computed_tokens == 0
    sim.run_until_done()
    assert big.num_output_tokens == small.num_output_tokens == 1


@BOTH_POLICIES
def test_preemption_when_blocks_run_out_completes_every_request(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=8, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    seqs = [sim.add(make_sequence(f"r{i}", num_prompt_tokens=8, max_tokens=16)) for i in range(4)]
    sim.run_until_done()
    assert sum(seq.num_preemptions for seq in seqs) > 0
    assert any(o.preempted for o in sim.outputs)
    for seq in seqs:
        assert seq.num_output_tokens == 16 and seq.finish_reason is FinishReason.LENGTH
    assert all(count == 1 for count in sim.num_finishes.values())
    # The oldest request is never preempted for a newer one.
    assert seqs[0].num_preemptions == 0


@BOTH_POLICIES
def test_preempted_seq_goes_to_the_front_of_waiting(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=4, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    old = sim.add(make_sequence("old", num_prompt_tokens=8, max_tokens=8))
    new = sim.add(make_sequence("new", num_prompt_tokens=8, max_tokens=8))
    sim.run_step()  # both admitted: 4 blocks in use
    later = sim.add(make_sequence("later", num_prompt_tokens=2, max_tokens=1))
    output = sim.run_step()  # old needs a 3rd block: new is preempted
    assert output.preempted == [new]
    assert [s.seq for s in output.scheduled] == [old]
    assert list(sim.scheduler.waiting) == [new, later]
    assert new.num_preemptions == 1 and new.num_computed_tokens == 0
    sim.run_until_done()
    assert new.num_output_tokens == 8 and later.num_output_tokens == 1


@BOTH_POLICIES
def test_seq_needing_a_block_preempts_itself_when_it_is_the_newest(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=4, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    old = sim.add(make_sequence("old", num_prompt_tokens=7, max_tokens=8))
    new = sim.add(make_sequence("new", num_prompt_tokens=8, max_tokens=8))
    sim.run_step()
    output = sim.run_step()  # old fits its block; new needs a 3rd block: new goes
    assert [s.seq for s in output.scheduled] == [old]
    assert output.preempted == [new]
    sim.run_until_done()
    assert old.num_output_tokens == new.num_output_tokens == 8


@BOTH_POLICIES
def test_shared_prompt_is_served_from_the_prefix_cache(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                            policy=policy)
    first = sim.add(make_sequence("a", num_prompt_tokens=20, max_tokens=3))
    sim.run_step()
    second = sim.add(make_sequence("b", token_ids=first.prompt_token_ids + [7, 8], max_tokens=2))
    output = sim.run_step()
    assert second.num_cached_tokens == 20
    assert [s.num_new_tokens for s in output.scheduled if s.seq is second] == [2]
    assert second.block_ids[:5] == first.block_ids[:5]
    sim.run_until_done()


@BOTH_POLICIES
def test_abort_frees_blocks_at_once(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=16, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    running = sim.add(make_sequence("run", num_prompt_tokens=10, max_tokens=50))
    sim.run_step()
    waiting = sim.add(make_sequence("wait", num_prompt_tokens=10, max_tokens=50))
    block_ids = list(running.block_ids)
    assert sim.abort("run") is running
    assert [sim.bm.blocks[b].ref_count for b in block_ids] == [0, 0, 0]
    assert sim.bm.num_free_blocks == sim.bm.num_total_blocks
    assert sim.abort("wait") is waiting and waiting.finish_reason is FinishReason.ABORT
    assert sim.abort("wait") is None and sim.abort("unknown") is None
    assert not sim.scheduler.has_unfinished
    assert sim.scheduler.schedule().is_empty


@BOTH_POLICIES
def test_abort_while_a_step_runs_is_ignored_by_update(policy: SchedulingPolicy) -> None:
    sim = Simulation.create(num_blocks=16, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                            policy=policy)
    sim.add(make_sequence("a", num_prompt_tokens=10, max_tokens=5))
    seq = sim.add(make_sequence("b", num_prompt_tokens=10, max_tokens=5))
    output = sim.scheduler.schedule()
    sim.abort("b")
    sim.scheduler.update_after_step(output)
    assert seq.num_computed_tokens == 0 and seq.block_ids == []
    sim.check_state()


def test_adding_a_request_id_twice_is_an_error() -> None:
    sim = Simulation.create(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    sim.add(make_sequence("a", num_prompt_tokens=3))
    with pytest.raises(ValueError, match="already scheduled"):
        sim.add(make_sequence("a", num_prompt_tokens=3))


def keyed(request_id: str, key: str, num_prompt_tokens: int, max_tokens: int = 16,
          priority: int = 0, weight: float = 1.0) -> Sequence:
    seq = make_sequence(request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
    seq.fair_key, seq.priority, seq.weight = key, priority, weight
    return seq


def fair_sim(**overrides: int) -> Simulation:
    shape = {"num_blocks": 256, "block_size": 4, "max_num_batched_tokens": 32, "max_num_seqs": 16}
    return Simulation.create(**(shape | overrides), policy=FAIR)  # type: ignore[arg-type]


def test_fair_new_key_is_admitted_ahead_of_a_flood_of_waiting_prompts() -> None:
    sim = fair_sim()
    noisy = [sim.add(keyed(f"n{i}", "noisy", 12, max_tokens=30)) for i in range(16)]
    for _ in range(3):
        sim.run_step()
    assert sum(s.status is SequenceStatus.WAITING for s in noisy) >= 3
    quiet = sim.add(keyed("q", "quiet", 12, max_tokens=2))
    output = sim.run_step()
    prompt_work = [(i.seq.request_id, i.num_new_tokens) for i in output.scheduled
                   if i.num_new_tokens > 1]
    assert prompt_work[0] == ("q", 12)  # its whole first chunk, before any noisy prompt
    assert quiet.first_scheduled_s is not None


def test_fcfs_new_key_waits_behind_the_flood() -> None:
    sim = Simulation.create(num_blocks=256, block_size=4, max_num_batched_tokens=32,
                            max_num_seqs=16, policy=FCFS)
    for i in range(16):
        sim.add(keyed(f"n{i}", "noisy", 12, max_tokens=30))
    for _ in range(3):
        sim.run_step()
    quiet = sim.add(keyed("q", "quiet", 12, max_tokens=2))
    output = sim.run_step()
    assert quiet not in [i.seq for i in output.scheduled]


def test_fair_new_key_runs_its_first_chunk_alone_then_decodes_resume() -> None:
    sim = fair_sim()
    sim.add(keyed("short", "noisy", 4, max_tokens=20))
    sim.add(keyed("long", "noisy", 200, max_tokens=2))
    sim.run_step()
    sim.add(keyed("q", "quiet", 10, max_tokens=3))  # lifted to the noisy key's counter
    first = sim.run_step()
    assert [(i.seq.request_id, i.num_new_tokens) for i in first.scheduled] == [("q", 10)]
    assert first.is_first_chunk_alone
    second = sim.run_step()  # decodes first again, then the long prompt by its counter
    assert [(i.seq.request_id, i.num_new_tokens) for i in second.scheduled] == [
        ("short", 1), ("q", 1), ("long", 30)]
    assert not second.is_first_chunk_alone
    sim.run_until_done()


def test_fair_first_chunks_alone_never_twice_in_a_row_nor_for_a_key_ahead() -> None:
    sim = fair_sim()
    sim.add(keyed("n0", "noisy", 8, max_tokens=20))
    sim.run_step()
    sim.add(keyed("q1", "quiet1", 8, max_tokens=2))
    sim.add(keyed("q2", "quiet2", 8, max_tokens=2))
    steps = [sim.run_step() for _ in range(2)]
    assert [s.is_first_chunk_alone for s in steps] == [True, False]
    assert [i.seq.request_id for i in steps[1].scheduled] == ["n0", "q1", "q2"]
    sim.run_until_done()
    # a key whose counter is ahead of the running ones' waits its turn in a mixed step
    sim.add(keyed("n1", "noisy", 8, max_tokens=20))
    sim.run_step()
    sim.scheduler.counters["quiet1"] = sim.scheduler.counters["noisy"] + 100
    sim.add(keyed("q3", "quiet1", 8, max_tokens=2))  # above the floor: no lift down
    output = sim.run_step()
    assert not output.is_first_chunk_alone
    assert [i.seq.request_id for i in output.scheduled] == ["n1", "q3"]
    sim.run_until_done()


def test_fair_higher_priority_class_goes_first_even_with_a_larger_counter() -> None:
    sim = fair_sim(max_num_batched_tokens=16)
    high = sim.add(keyed("h0", "high", 16, max_tokens=1, priority=1))
    sim.run_step()  # the high key's counter is now 16
    low = sim.add(keyed("l0", "low", 16, max_tokens=1))
    high2 = sim.add(keyed("h1", "high", 16, max_tokens=1, priority=1))
    assert sim.scheduler.counters["high"] > sim.scheduler.counters["low"]
    output = sim.run_step()
    assert [i.seq for i in output.scheduled] == [high2]
    sim.run_until_done()
    assert high.is_finished and low.num_output_tokens == 1


def test_fair_counters_charge_computed_tokens_by_weight_and_lift_returning_keys() -> None:
    sim = fair_sim()
    sim.add(keyed("a", "a", 8, max_tokens=4, weight=2.0))
    sim.run_step()
    assert sim.scheduler.counters == {"a": 4.0}  # 8 prompt tokens / weight 2
    sim.add(keyed("b", "b", 8, max_tokens=40))
    assert sim.scheduler.counters["b"] == 4.0  # lifted to the smallest active counter
    sim.run_until_done()  # a leaves with 3 more decodes (+1.5); b keeps going alone
    counters = dict(sim.scheduler.counters)
    assert counters["a"] == 5.5 and counters["b"] == 4.0 + 8 + 39
    sim.add(keyed("a2", "a", 4, max_tokens=1, weight=2.0))
    assert sim.scheduler.counters["a"] == 5.5  # nobody active: no lift, no credit lost
    sim.add(keyed("b2", "b", 4, max_tokens=1))
    assert sim.scheduler.counters["b"] == counters["b"]  # above the floor: kept


def test_fair_prompt_budget_is_split_by_weight() -> None:
    sim = fair_sim(max_num_batched_tokens=24, max_num_seqs=64, num_blocks=4096)
    for i in range(40):
        sim.add(keyed(f"h{i}", "heavy", 24, max_tokens=1, weight=2.0))
        sim.add(keyed(f"l{i}", "light", 24, max_tokens=1, weight=1.0))
    served: Counter[str] = Counter()
    for _ in range(30):
        for item in sim.run_step().scheduled:
            served[item.seq.fair_key] += item.num_new_tokens
    assert 1.8 <= served["heavy"] / served["light"] <= 2.2, served
    sim.run_until_done()


def test_fair_prompt_work_beside_decodes_is_capped() -> None:
    sim = fair_sim(max_num_batched_tokens=64)
    sim.scheduler.config = SchedulerConfig(64, 16, FAIR, max_prompt_tokens_with_decodes=10)
    long = sim.add(keyed("long", "a", 100, max_tokens=2))
    first = sim.run_step()  # nothing decodes yet: the whole budget
    assert [i.num_new_tokens for i in first.scheduled] == [64]
    sim.add(keyed("short", "a", 4, max_tokens=30))
    sim.run_step()  # still no decode: long's last 36 tokens and short's 4, uncapped
    assert long.num_output_tokens == 1
    output = sim.run_step()  # long and short decode; nothing prompts: decodes only
    assert sum(i.num_new_tokens for i in output.scheduled) == 2
    late = sim.add(keyed("late", "a", 30, max_tokens=1))
    chunks = []
    while late.num_output_tokens == 0:
        output = sim.run_step()
        chunks += [i.num_new_tokens for i in output.scheduled if i.seq is late]
    assert chunks == [10, 10, 10]  # beside the short seq's decodes
    sim.run_until_done()
    with pytest.raises(ValueError, match="max_prompt_tokens_with_decodes"):
        SchedulerConfig(64, 16, FAIR, max_prompt_tokens_with_decodes=0)


def test_fair_preemption_takes_the_lowest_priority_class_first() -> None:
    sim = fair_sim(num_blocks=6, max_num_batched_tokens=32)
    low = sim.add(keyed("low", "low", 8, max_tokens=8))
    high_a = sim.add(keyed("high_a", "high", 7, max_tokens=8, priority=1))
    high_b = sim.add(keyed("high_b", "high", 8, max_tokens=8, priority=1))
    sim.run_step()  # 6 blocks: 2 each
    output = sim.run_step()  # low and high_b need a 3rd block; high_a fits its 8th token
    assert output.preempted == [low]  # the oldest, but of the lower class
    assert {i.seq.request_id for i in output.scheduled} == {"high_a", "high_b"}
    sim.run_until_done()
    assert high_a.num_preemptions == 0  # the oldest of the highest class
    assert low.num_output_tokens == high_b.num_output_tokens == 8


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.integers(1, 8))
    num_requests = draw(st.integers(1, 10))
    # Prompts over a tiny alphabet share prefixes often, so the prefix cache gets exercised.
    prompts = draw(
        st.lists(
            st.lists(st.integers(0, 2), min_size=1, max_size=40),
            min_size=num_requests,
            max_size=num_requests,
        )
    )
    max_tokens = draw(st.lists(st.integers(1, 20), min_size=num_requests, max_size=num_requests))
    arrivals = draw(st.lists(st.integers(0, 15), min_size=num_requests, max_size=num_requests))
    tenants = draw(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 1),
                                      st.sampled_from([0.5, 1.0, 3.0])),
                            min_size=num_requests, max_size=num_requests))
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    min_blocks = -(-longest // block_size)  # every request fits when alone
    return {
        "block_size": block_size,
        "num_blocks": min_blocks + draw(st.integers(0, 12)),
        "max_num_batched_tokens": draw(st.integers(1, 48)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "enable_prefix_caching": draw(st.booleans()),
        "policy": draw(st.sampled_from([FAIR, FCFS])),
        "max_prompt_tokens_with_decodes": draw(st.one_of(st.none(), st.integers(1, 16))),
        "requests": list(zip(prompts, max_tokens, arrivals, tenants, strict=True)),
        "aborts": draw(
            st.lists(st.tuples(st.integers(0, 40), st.integers(0, num_requests - 1)), max_size=5)
        ),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_finish_every_request(workload: dict) -> None:
    sim = Simulation.create(
        workload["num_blocks"],
        workload["block_size"],
        workload["max_num_batched_tokens"],
        workload["max_num_seqs"],
        workload["enable_prefix_caching"],
        workload["policy"],
        workload["max_prompt_tokens_with_decodes"],
    )
    requests = workload["requests"]
    seqs: dict[str, Sequence] = {}
    last_arrival = max(arrival for _, _, arrival, _ in requests)
    while sim.step <= last_arrival or sim.scheduler.has_unfinished:
        assert sim.step < MAX_STEPS, "the scheduler stopped making progress"
        for index, (prompt, max_tokens, arrival, tenant) in enumerate(requests):
            if arrival == sim.step:
                seq = make_sequence(f"r{index}", token_ids=prompt, max_tokens=max_tokens)
                seq.fair_key, seq.priority, seq.weight = tenant
                seqs[seq.request_id] = sim.add(seq)
        for step, index in workload["aborts"]:
            if step == sim.step:
                sim.abort(f"r{index}")
        sim.run_step()

    assert set(sim.num_finishes) == set(seqs) and set(sim.num_finishes.values()) == {1}
    for seq in seqs.values():
        assert seq.is_finished and seq.block_ids == []
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.sampling.max_tokens
        else:
            assert seq.finish_reason is FinishReason.ABORT
            assert seq.num_output_tokens < seq.sampling.max_tokens
    assert sim.bm.num_free_blocks == sim.bm.num_total_blocks
    assert sim.bm.num_used_blocks == 0
    assert sim.scheduler.num_running == sim.scheduler.num_waiting == 0
