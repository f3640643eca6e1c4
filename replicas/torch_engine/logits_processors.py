"""Batched logit processing: ``logit_bias``, the repetition, frequency and presence penalties,
and ``min_p``.

NOTE: every function here works on all its rows at once, whatever their parameters: the
per-request values become (rows,) tensors and the token lists become one flat index, so a
batch of 32 requests costs a handful of tensor operations, not 32 of each. A row whose
parameter is neutral (penalty 1 or 0, no bias) comes out unchanged. The sampler calls them
only for the rows that asked for something, so a batch without these features pays nothing.
``apply_logit_bias`` and ``apply_penalties`` change the logits they are given, in place, and
return them (the sampler owns its copy: a (32, 49152) copy costs more than the work itself).

The penalty formulas are vLLM's (``vllm/model_executor/layers/utils.py``): first the
repetition penalty over the prompt and the output (transformers'
``RepetitionPenaltyLogitsProcessor``: a seen token's logit is divided by the penalty when
positive, multiplied when not), then ``logits -= frequency * count + presence * (count > 0)``
with ``count`` the token's occurrences in the output so far (OpenAI's definition).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import chain

import torch

from replicas.torch_engine.sequence import Sequence


def _flat_index(token_lists: Seq[Seq[int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of every token of every row's list: two (total,) tensors."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    return rows.to(device), tokens.to(device)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: (rows, vocab), row i for seqs[i]; each row's bias added to its tokens."""
    biases = [s.sampling.logit_bias for s in seqs]
    rows, tokens = _flat_index([[t for t, _ in b] for b in biases], logits.device)
    values = torch.tensor([v for _, v in chain.from_iterable(biases)], dtype=logits.dtype,
                          device=logits.device)
    return logits.index_put_((rows, tokens), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: (rows, vocab), row i for seqs[i]; repetition, frequency and presence.

    Only the (row, token) places of tokens a row has seen are read and written, so the cost
    follows the number of tokens, not rows x vocab.
    """
    vocab = logits.shape[1]
    device, dtype = logits.device, logits.dtype
    repetition = torch.tensor([s.sampling.repetition_penalty for s in seqs], dtype=dtype,
                              device=device)
    rows, tokens = _flat_index([s.token_ids for s in seqs], device)  # prompt and output
    seen = logits[rows, tokens]  # a token seen twice is read and written twice, the same way
    factor = repetition[rows]
    logits[rows, tokens] = torch.where(seen > 0, seen / factor, seen * factor)

    rows, tokens = _flat_index([s.output_token_ids for s in seqs], device)  # output only
    places, counts = torch.unique(rows * vocab + tokens, return_counts=True)
    rows, tokens = places // vocab, places % vocab
    frequency = torch.tensor([s.sampling.frequency_penalty for s in seqs], dtype=dtype,
                             device=device)
    presence = torch.tensor([s.sampling.presence_penalty for s in seqs], dtype=dtype,
                            device=device)
    logits[rows, tokens] -= frequency[rows] * counts.to(dtype) + presence[rows]
    return logits


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """logits: (rows, vocab) after temperature; tokens whose probability is under
    ``min_p`` times the row's top probability are dropped (vLLM's ``min_p``)."""
    probs = torch.softmax(logits, dim=-1)
    floor = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
    top = probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor * top, float("-inf"))
