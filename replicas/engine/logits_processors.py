"""Batched logit processing: ``logit_bias``, the repetition, frequency and presence penalties,
and ``min_p``.

NOTE: every function here works on all its rows at once, whatever their parameters: the
per-request values become (rows,) tensors and the token lists become one flat index, so a
batch of 32 requests costs a handful of tensor operations, not 32 of each. A row whose
parameter is neutral (penalty 1 or 0, no bias) comes out unchanged. The sampler calls them
only for the rows that asked for something, so a batch without these features pays nothing.

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

from replicas.engine.sequence import Sequence


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
    return logits.index_put((rows, tokens), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: (rows, vocab), row i for seqs[i]; repetition, frequency and presence."""
    num_rows, vocab = logits.shape
    device, dtype = logits.device, logits.dtype
    repetition = torch.tensor([s.sampling.repetition_penalty for s in seqs], dtype=dtype,
                              device=device)[:, None]
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    seen[_flat_index([s.token_ids for s in seqs], device)] = True  # prompt and output
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)

    counts = torch.zeros(num_rows, vocab, dtype=dtype, device=device)  # output tokens only
    rows, tokens = _flat_index([s.output_token_ids for s in seqs], device)
    counts.index_put_((rows, tokens), torch.ones(len(tokens), dtype=dtype, device=device),
                      accumulate=True)
    frequency = torch.tensor([s.sampling.frequency_penalty for s in seqs], dtype=dtype,
                             device=device)[:, None]
    presence = torch.tensor([s.sampling.presence_penalty for s in seqs], dtype=dtype,
                            device=device)[:, None]
    return logits - frequency * counts - presence * (counts > 0).to(dtype)


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """logits: (rows, vocab) after temperature; tokens whose probability is under
    ``min_p`` times the row's top probability are dropped (vLLM's ``min_p``)."""
    probs = torch.softmax(logits, dim=-1)
    floor = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
    top = probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor * top, float("-inf"))
