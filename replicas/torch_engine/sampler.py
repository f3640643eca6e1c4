"""Turns a step's logits into tokens: logit processing (``min_tokens``, ``logit_bias``,
penalties, the structured-output grammar), then greedy, or temperature, min-p, top-k, top-p
and a draw; per-request seeds.

NOTE: a draw is the exponential race (Gumbel-max): token = argmax(p_i / E_i) with E_i = -log U_i
and U_i uniform, which draws exactly from p. A seeded request draws its uniforms from a
generator seeded by ``(seed, position)``, the position being the output token's index: its
tokens depend on nothing but its seed, its position and its own logits, so the same seed and
prompt give the same text whatever shares the batch, after preemption, and after a migration
to another replica that resumes at position k (it draws what the first run would have drawn).
The race, not an inverse CDF: a resumed run recomputes the context in a prefill, whose logits
differ from the first run's decode steps by ~5e-5, and a CDF over 49,152 tokens has boundaries
closer than that in its long tail (one flip in every ~50 seeded tokens, measured), while the
race only flips when its two best scores tie that closely. Uniforms with a log (5.6 ms for 32
rows) instead of ``exponential_`` (31 ms). Requests without a seed share the sampler's
generator.

The logit processing runs only on the rows that asked for it (``logits_processors.py``,
``guide.py``), batched; a step without such rows pays one attribute check per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.engine.interface import TokenLogprob
from replicas.torch_engine.guide import apply_guides
from replicas.torch_engine.logits_processors import apply_logit_bias, apply_min_p, apply_penalties
from replicas.torch_engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


MASK_64 = 2**64 - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's token at ``position`` (splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], device: torch.device, seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._seeded = torch.Generator(device=device)  # re-seeded for every seeded draw

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """logits: (num_seqs, vocab) float32, row i for seqs[i]."""
        raw = logits  # logprobs are the model's own distribution's
        logits = self._suppress_early_stops(logits, seqs)
        logits = _process(logits, seqs)
        token_ids = logits.argmax(dim=-1)  # greedy rows keep this
        sampling_rows = [i for i, s in enumerate(seqs) if not s.sampling.is_greedy]
        if sampling_rows:
            rows = torch.tensor(sampling_rows, device=logits.device)
            probs = _filtered_probs(logits[rows], [seqs[i] for i in sampling_rows])
            token_ids[rows] = self._draw(probs, [seqs[i] for i in sampling_rows])
        ids = token_ids.tolist()
        logprobs = self._logprobs(raw, token_ids, seqs)
        return [SampledToken(token_id=t, logprob=lp) for t, lp in zip(ids, logprobs, strict=True)]

    def _suppress_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Before min_tokens are out, EOS and stop tokens cannot be sampled (unless a grammar
        decides where the output ends: its complete JSON may allow nothing else)."""
        early = [i for i, s in enumerate(seqs)
                 if s.num_output_tokens < s.sampling.min_tokens and s.guide is None]
        if not early:
            return logits
        logits = logits.clone()
        for i in early:
            params = seqs[i].sampling
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """probs: (rows, vocab); one token id per row by the exponential race (the NOTE)."""
        uniforms = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand((len(unseeded), probs.shape[1]), generator=self._shared,
                                            device=probs.device)
        for i, seq in enumerate(seqs):
            if seq.sampling.seed is not None:
                self._seeded.manual_seed(position_seed(seq.sampling.seed % 2**64,
                                                       seq.num_output_tokens))
                uniforms[i] = torch.rand(probs.shape[1], generator=self._seeded,
                                         device=probs.device)
        return (probs / -uniforms.log()).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, seqs: list[Sequence]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, s in enumerate(seqs) if s.sampling.logprobs]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not wanted:
            return out
        # Log-probabilities of the model's own distribution (before temperature and filters).
        logp = torch.log_softmax(logits[wanted], dim=-1)
        for row, i in enumerate(wanted):
            token = int(token_ids[i])
            top_n = seqs[i].sampling.top_logprobs
            top: tuple[tuple[int, float], ...] = ()
            if top_n:
                values, indices = logp[row].topk(top_n)
                top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
            out[i] = TokenLogprob(token_id=token, logprob=float(logp[row, token]), top=top)
        return out


def _process(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logit_bias, penalties and grammars on the rows that have them; (num_seqs, vocab)."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.has_logit_processing]
    if not rows:
        return logits
    logits = logits.clone()  # the caller keeps the unprocessed logits for logprobs
    steps = ((lambda s: bool(s.sampling.logit_bias), apply_logit_bias),
             (lambda s: s.sampling.has_penalties, apply_penalties),
             (lambda s: s.guide is not None, _apply_guides))
    for wants, apply in steps:
        chosen = [i for i in rows if wants(seqs[i])]
        if len(chosen) == len(seqs):  # every row: no gather and scatter of the rows
            apply(logits, seqs)
        elif chosen:
            index = torch.tensor(chosen, device=logits.device)
            logits[index] = apply(logits[index], [seqs[i] for i in chosen])
    return logits


def _apply_guides(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return apply_guides(logits, [s.guide for s in seqs if s.guide is not None])


def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p; returns (rows, vocab) probabilities."""
    temps = torch.tensor([s.sampling.temperature for s in seqs], device=logits.device)
    logits = logits / temps[:, None]
    min_ps = [s.sampling.min_p for s in seqs]
    if any(p > 0.0 for p in min_ps):
        logits = apply_min_p(logits, min_ps)
    top_ks = [s.sampling.top_k for s in seqs]
    top_ps = [s.sampling.top_p for s in seqs]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= ks[:, None]  # beyond top-k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    ps = torch.tensor(top_ps, device=logits.device)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= ps[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
