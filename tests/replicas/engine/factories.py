"""Factories for engine tests: sequences with made-up prompts, no tokenizer, no model."""

from __future__ import annotations

import zlib

from replicas.engine.sampling_params import SamplingParams
from replicas.engine.sequence import Sequence

FAKE_VOCAB_SIZE = 50_000


def make_token_ids(request_id: str, num_tokens: int) -> list[int]:
    """A prompt that is the same for the same request id and unlikely to share a prefix."""
    start = zlib.crc32(request_id.encode()) % FAKE_VOCAB_SIZE
    return [(start + 7 * i) % FAKE_VOCAB_SIZE for i in range(num_tokens)]


def make_sequence(
    request_id: str,
    num_prompt_tokens: int | None = None,
    token_ids: list[int] | None = None,
    max_tokens: int = 16,
    **sampling_kwargs: object,
) -> Sequence:
    """A sequence from ``token_ids``, or from ``num_prompt_tokens`` made-up tokens."""
    if (num_prompt_tokens is None) == (token_ids is None):
        raise TypeError("give exactly one of num_prompt_tokens and token_ids")
    if token_ids is None:
        assert num_prompt_tokens is not None
        token_ids = make_token_ids(request_id, num_prompt_tokens)
    sampling = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)  # type: ignore[arg-type]
    return Sequence.from_prompt(request_id, token_ids, sampling)


# The shape of the tiny random-weight models the model and loader tests build.
TINY_MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
