"""The checks a request passes before it reaches vLLM, so a bad one raises
``InvalidRequestError`` naming its field before anything is scheduled.

They are the torch engine's (``EngineCore.prepare``) against the limits vLLM reports for its
model. vLLM checks most of them again itself (its errors are mapped by ``errors.py``), but with
messages and parameter names of its own, and it silently lets ``max_tokens`` run past the
context (ending with "length") where fairserve refuses the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replicas.engine.errors import InvalidRequestError
from replicas.engine.interface import GenerateRequest


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What vLLM's engine takes: token ids in [0, vocab_size), prompt + output within
    ``max_model_len``, at most ``max_num_seqs`` sequences at once."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int


def check_request(request: GenerateRequest, prompt_token_ids: Sequence[int],
                  limits: ModelLimits) -> None:
    """Raises ``InvalidRequestError`` naming the field a request the engine cannot take."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", prompt_param(request))
    vocab = limits.vocab_size
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    max_tokens = request.sampling.max_tokens
    if len(prompt_token_ids) + max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)} and max_tokens is {max_tokens}",
            "max_tokens")
    outside = [t for t, _ in request.sampling.logit_bias if t >= vocab]
    if outside:
        raise InvalidRequestError(
            f"logit_bias: token id {outside[0]} is not in the vocabulary [0, {vocab})",
            "logit_bias")
    if request.sampling.n > limits.max_num_seqs:
        raise InvalidRequestError(
            f"n ({request.sampling.n}) exceeds the sequences this engine runs at once "
            f"({limits.max_num_seqs})", "n")


def given_prompt_count(request: GenerateRequest) -> int:
    """How many of prompt_token_ids, prompt and messages the request gives (one is right)."""
    return sum(x is not None for x in (request.prompt_token_ids, request.prompt,
                                       request.messages))


def prompt_param(request: GenerateRequest) -> str:
    return "messages" if request.messages is not None else "prompt"
