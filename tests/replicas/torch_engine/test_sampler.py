"""The sampler on synthetic logits: filters, seeds, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from replicas.engine.errors import InvalidRequestError
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.sampler import Sampler
from tests.replicas.torch_engine.factories import make_sequence

EOS = 7


def _sampler() -> Sampler:
    return Sampler((EOS,), torch.device("cpu"), seed=0)


def _logits(rows: int = 1, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_argmax() -> None:
    logits = _logits(3)
    seqs = [make_sequence(f"g{i}", num_prompt_tokens=4, temperature=0.0) for i in range(3)]
    got = [s.token_id for s in _sampler().sample(logits, seqs)]
    assert got == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(2)
    seqs = [
        make_sequence("k", num_prompt_tokens=4, temperature=1.0, top_k=1),
        make_sequence("p", num_prompt_tokens=4, temperature=1.0, top_p=1e-6),
    ]
    sampler = _sampler()
    for _ in range(20):
        assert [s.token_id for s in sampler.sample(logits, seqs)] == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = _logits(1, seed=3)
    allowed = set(logits[0].topk(5).indices.tolist())
    seq = make_sequence("k5", num_prompt_tokens=4, temperature=1.5, top_k=5)
    sampler = _sampler()
    seen = {sampler.sample(logits, [seq])[0].token_id for _ in range(300)}
    assert seen <= allowed and len(seen) >= 3


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0, -6.0]])
    probs = torch.softmax(logits[0], -1)
    # p(0) + p(1) ≈ 0.91: a top_p of 0.9 keeps exactly tokens 0 and 1
    assert probs[0] < 0.9 < probs[0] + probs[1]
    seq = make_sequence("p", num_prompt_tokens=4, temperature=1.0, top_p=0.9)
    sampler = _sampler()
    seen = {sampler.sample(logits, [seq])[0].token_id for _ in range(300)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    expected = torch.softmax(logits[0] / 0.8, -1)
    seq = make_sequence("d", num_prompt_tokens=4, temperature=0.8)
    sampler = _sampler()
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sampler.sample(logits, [seq])[0].token_id] += 1
    # within 4 standard deviations of a multinomial count
    sd = torch.sqrt(n * expected * (1 - expected))
    assert torch.all((counts - n * expected).abs() < 4 * sd), (counts / n, expected)


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = _logits(4, seed=5)
    params = dict(temperature=1.0, seed=42)

    def draw(batch_rows: list[int], target_row: int) -> list[int]:
        sampler = _sampler()
        seqs = [make_sequence(f"s{r}", num_prompt_tokens=4, temperature=1.0, seed=None) for r in batch_rows]
        target = make_sequence("target", num_prompt_tokens=4, **params)
        seqs.insert(target_row, target)
        rows = batch_rows[:target_row] + [0] + batch_rows[target_row:]
        tokens = []
        for _ in range(30):
            tokens.append(sampler.sample(logits[rows], seqs)[target_row].token_id)
            target.append_token(tokens[-1])  # as the engine does: the position advances
        return tokens

    alone = draw([], 0)
    crowded = draw([1, 2, 3], 2)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples


def test_a_seeded_draw_depends_on_the_position_not_the_history() -> None:
    """What makes a migrated request sample what the uninterrupted one would have: another
    sampler, a sequence rebuilt from the same output, the same draw."""
    logits = _logits(1, seed=9)
    first = make_sequence("first", num_prompt_tokens=4, temperature=1.0, seed=7)
    sampler = _sampler()
    tokens = []
    for _ in range(12):
        tokens.append(sampler.sample(logits, [first])[0].token_id)
        first.append_token(tokens[-1])
    resumed = make_sequence("resumed", token_ids=first.prompt_token_ids, temperature=1.0, seed=7)
    for token in tokens[:5]:
        resumed.append_token(token)  # the 5 tokens the client had
    other = _sampler()  # a fresh replica
    again = []
    for _ in range(7):
        again.append(other.sample(logits, [resumed])[0].token_id)
        resumed.append_token(again[-1])
    assert again == tokens[5:]


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.full((1, 10), -10.0)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    logits[0, 5] = 1.0
    seq = make_sequence("m", num_prompt_tokens=4, temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=(3,))
    assert _sampler().sample(logits, [seq])[0].token_id == 5
    seq.append_token(5)
    seq.append_token(5)  # min_tokens reached: EOS is allowed again
    assert _sampler().sample(logits, [seq])[0].token_id == EOS


def test_logprobs_are_of_the_unmodified_distribution() -> None:
    logits = _logits(1, seed=9)
    seq = make_sequence("l", num_prompt_tokens=4, temperature=0.5, top_k=3, logprobs=True, top_logprobs=4, seed=1)
    out = _sampler().sample(logits, [seq])[0]
    logp = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprob.logprob, float(logp[out.token_id]), rel_tol=1e-5)
    assert [t for t, _ in out.logprob.top] == logp.topk(4).indices.tolist()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"seed": "x"}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_invalid_parameters_name_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
