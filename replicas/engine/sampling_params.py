"""Sampling parameters of one request, validated before anything is scheduled.

The names and ranges are vLLM's (``vllm.SamplingParams``) and OpenAI's, so a request that
vLLM accepts means the same here.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.engine.errors import InvalidRequestError
from replicas.protocol import (  # the limits the router checks too; the fields
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_PRESENCE_FREQUENCY_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    CallSampling,
    GuideKind,
    StructuredOutput,
)

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_ENTRIES", "MAX_N", "MAX_PRESENCE_FREQUENCY_PENALTY",
           "MAX_REPETITION_PENALTY", "MAX_STOP_STRINGS", "MAX_TEMPERATURE", "MAX_TOP_LOGPROBS",
           "GuideKind", "SamplingParams", "StructuredOutput"]


@dataclass(frozen=True, slots=True)
class SamplingParams(CallSampling):
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy (``top_p``/``top_k``/``min_p`` are then ignored). ``top_k``
    0 means off. ``seed`` makes sampling reproducible per request: the same seed and prompt give
    the same output whatever else shares the batch. ``logprobs`` returns the log-probability of
    each sampled token under the model's unmodified distribution, plus the ``top_logprobs``
    most likely alternatives.

    Logit processing, in order: ``logit_bias`` (token id -> added to its logit), then the
    penalties: ``repetition_penalty`` (vLLM's and transformers': a logit of a token already in
    the prompt or the output is divided by it when positive, multiplied when negative),
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's: minus ``frequency * count +
    presence * (count > 0)``, counting the generated tokens only); then the structured-output
    grammar, temperature, ``min_p`` (drop tokens under ``min_p`` times the top probability),
    top-k and top-p. ``n`` choices are ``n`` sequences on one prompt; a seeded request's choice
    ``i`` samples with ``seed + i`` (vLLM's rule).

    The fields and defaults are the replica call's (``replicas.protocol.CallSampling``, what
    the router sends); this class adds the checks.
    """

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, low_open=False)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a list of strings", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", "stop"
            )
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(
                f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters", "stop")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        _check_int("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        _check_int("n", self.n, low=1, high=MAX_N)
        self._check_processing()

    def _check_processing(self) -> None:
        _check_float("min_p", self.min_p, 0.0, 1.0, low_open=False)
        if isinstance(self.repetition_penalty, bool) or not isinstance(
                self.repetition_penalty, (int, float)) or not (
                    0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty!r}",
                "repetition_penalty")
        limit = MAX_PRESENCE_FREQUENCY_PENALTY
        _check_float("presence_penalty", self.presence_penalty, -limit, limit, low_open=False)
        _check_float("frequency_penalty", self.frequency_penalty, -limit, limit, low_open=False)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"logit_bias has {len(self.logit_bias)} entries; at most "
                                      f"{MAX_LOGIT_BIAS_ENTRIES} are allowed", "logit_bias")
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias", token_id, low=0)
            _check_float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, low_open=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_logit_processing(self) -> bool:
        """Anything that changes the logits before sampling (cheap to ask every step)."""
        return bool(self.logit_bias) or self.has_penalties or self.structured_output is not None


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}", name)


def _check_float(name: str, value: object, low: float, high: float, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    if value != value or value > high or value < low or (low_open and value == low):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidRequestError(f"{name} must be in {interval}, got {value}", name)
