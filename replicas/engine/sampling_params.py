"""Sampling parameters of one request, validated before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass

from replicas.engine.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy (``top_p``/``top_k`` are then ignored). ``top_k`` 0 means off.
    ``seed`` makes sampling reproducible per request: the same seed and prompt give the same
    output whatever else shares the batch. ``logprobs`` returns the log-probability of each
    sampled token under the model's unmodified distribution, plus the ``top_logprobs`` most
    likely alternatives.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True

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
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        _check_int("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
