"""Batched logit processing against slow, readable references: transformers' own
``RepetitionPenaltyLogitsProcessor``, and vLLM's documented frequency/presence formula and
``min_p`` written out one row and one token at a time."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from replicas.engine.errors import InvalidRequestError
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
)
from tests.replicas.torch_engine.factories import make_sequence

VOCAB = 64


def batch(seed: int, num_rows: int = 6) -> tuple[torch.Tensor, list]:
    """Random logits and sequences with random prompts, outputs and penalties (some neutral)."""
    rng = random.Random(seed)
    seqs = []
    for i in range(num_rows):
        seq = make_sequence(
            f"r{i}", token_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))],
            repetition_penalty=rng.choice([1.0, 0.8, 1.3, 2.0]),
            frequency_penalty=rng.choice([0.0, -0.5, 0.7, 2.0]),
            presence_penalty=rng.choice([0.0, 1.1, -2.0]))
        for _ in range(rng.randint(0, 10)):
            seq.append_token(rng.randrange(VOCAB))
        seqs.append(seq)
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)), seqs


def reference_penalties(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.sampling
        # transformers' processor over prompt + output, as a decoder-only model's input_ids
        ids = torch.tensor([seq.token_ids])
        out[row] = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, out[row:row + 1])[0] \
            if p.repetition_penalty != 1.0 else out[row]
        for token in range(VOCAB):  # vLLM: logits -= freq * count + presence * (count > 0)
            count = seq.output_token_ids.count(token)
            out[row, token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_penalties_equal_transformers_and_the_documented_formula(seed: int) -> None:
    logits, seqs = batch(seed)
    assert torch.allclose(apply_penalties(logits.clone(), seqs),
                          reference_penalties(logits, seqs), atol=1e-6)


def test_neutral_rows_are_untouched_and_penalties_change_the_pick() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 3.0
    logits[:, 6] = 2.9
    neutral = make_sequence("a", token_ids=[5, 5])
    penalized = make_sequence("b", token_ids=[1], frequency_penalty=0.5)
    penalized.append_token(5)
    out = apply_penalties(logits.clone(), [neutral, penalized])
    assert torch.equal(out[0], logits[0])
    assert out[1].argmax() == 6 and out[1, 5] == 2.5


def test_logit_bias_adds_per_row_and_minus_100_bans() -> None:
    logits = torch.zeros(3, VOCAB)
    seqs = [make_sequence("a", token_ids=[1], logit_bias=((3, 5.0), (7, -100.0))),
            make_sequence("b", token_ids=[1]),
            make_sequence("c", token_ids=[1], logit_bias=((3, -1.5),))]
    out = apply_logit_bias(logits.clone(), seqs)
    assert out[0, 3] == 5.0 and out[0, 7] == -100.0 and out[2, 3] == -1.5
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out) == 3


def test_min_p_keeps_tokens_within_the_ratio_of_the_top_one() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    min_ps = [0.0, 0.05, 0.3, 1.0]
    out = apply_min_p(logits, min_ps)
    for row, min_p in enumerate(min_ps):
        probs = torch.softmax(logits[row], dim=-1)
        kept = probs >= min_p * probs.max()
        assert torch.equal(torch.isfinite(out[row]), kept)
        assert torch.equal(out[row][kept], logits[row][kept])


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("min_p", 1.5), ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),)),
    ("logit_bias", tuple((i, 1.0) for i in range(301))), ("n", 0),
])
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert caught.value.param == field
