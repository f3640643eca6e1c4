"""Factories for engine tests: sequences with made-up prompts, no tokenizer, no model;
transformers' own model on a model source's weights, the reference the engine is held to."""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass
from typing import Any

from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.sequence import Sequence

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


def hf_reference_model(source: Any) -> Any:
    """transformers' causal LM with ``source``'s weights, float32, eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(source.config.to_hf_config(),
                                                          dtype=torch.float32)
    state = {f"model.{name}" if name != "lm_head.weight" else name: w
             for name, w in source.weights()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


NEAR_TIE_GAP = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[Any]  # one (vocab,) tensor per generated token


def check_greedy_tokens(case: str, index: int, ref: Reference, got: list[int]) -> None:
    """``got`` equals the reference's tokens, except where float rounding between batch shapes
    flips a near-tie: there the engine's token must be the reference's runner-up with a logit
    gap under ``NEAR_TIE_GAP`` (reported as a warning; the rest is not compared)."""
    for pos, (want, have) in enumerate(zip(ref.token_ids, got, strict=False)):
        if want == have:
            continue
        values, indices = ref.logits[pos].topk(2)
        gap = float(values[0] - values[1])
        assert have == int(indices[1]) and gap < NEAR_TIE_GAP, (
            f"{case}: prompt {index} diverges at output token {pos}: engine {have}, reference "
            f"{want} (reference top-2 {indices.tolist()}, gap {gap:.2e})"
        )
        warnings.warn(
            f"near-tie in {case}: prompt {index}, token {pos}: engine took the runner-up "
            f"{have} over {want}, logit gap {gap:.2e}",
            stacklevel=1,
        )
        return
    assert got == ref.token_ids, f"{case}: prompt {index}: {got} != {ref.token_ids}"
