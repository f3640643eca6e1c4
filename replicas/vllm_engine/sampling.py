"""fairserve ``SamplingParams`` -> the keyword arguments of ``vllm.SamplingParams``.

Pure translation: nothing here imports vLLM, so it runs (and is tested) without it. The engine
adds what needs vLLM's own types: ``output_kind=RequestOutputKind.DELTA`` and the structured
output constraint wrapped in ``StructuredOutputsParams`` (newer vLLM, 0.34 among them; keyword
``structured_outputs``) or ``GuidedDecodingParams`` (vLLM 0.10, keyword ``guided_decoding``).

NOTE: the names and ranges of fairserve's sampling parameters are vLLM's, so most fields map
one to one. The differences, checked against vLLM 0.10.0 and 0.34.0:

- ``top_k``: fairserve 0 means off; vLLM takes 0 (its default) or -1 for off since 0.10, so 0
  passes through unchanged.
- ``seed``: vLLM turns -1 into "no seed" and hands the rest to ``torch.Generator``, which takes
  a seed modulo 2**64. fairserve's seeds go out reduced modulo 2**64, so -1 stays a seed (the
  same generator seed as 2**64 - 1) and ``seed + index`` of a choice never overflows.
- ``logprobs``: vLLM's ``logprobs`` is None (off) or the number of top alternatives; it always
  returns the sampled token's logprob too, under the raw model distribution (its default
  ``logprobs_mode``), which is what fairserve's ``logprobs`` means.
- ``n``: vLLM refuses ``n > 1`` with greedy sampling, and a migrated request's choices stand at
  different points; the engine therefore runs every choice as its own vLLM request
  (``choice_kwargs``), seeded ``seed + index`` as vLLM's own fan-out does.
- temperatures in (0, 0.01) are raised to 0.01 by vLLM (it warns); fairserve does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from replicas.engine.errors import InvalidRequestError
from replicas.engine.sampling_params import GuideKind, SamplingParams, StructuredOutput
from replicas.protocol import GrammarError, grammar_for

SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes its seed modulo 2**64


@dataclass(frozen=True, slots=True)
class VLLMSampling:
    """What one vLLM request is sampled with.

    ``kwargs``: keyword arguments of ``vllm.SamplingParams`` (all but ``output_kind`` and the
    structured output). ``constraint``: keyword arguments of vLLM's structured output params
    (``{"json": schema}`` or ``{"json_object": True}``), None without one.
    """

    kwargs: dict[str, Any]
    constraint: dict[str, Any] | None = None


def sampling_kwargs(params: SamplingParams) -> VLLMSampling:
    """The whole request's parameters in vLLM's terms (``n`` included)."""
    kwargs: dict[str, Any] = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 is off in both
        "min_p": params.min_p,
        "seed": vllm_seed(params.seed),
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
        "logprobs": params.top_logprobs if params.logprobs else None,
        "skip_special_tokens": params.skip_special_tokens,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        # a later entry for the same token wins, as in a JSON object
        "logit_bias": dict(params.logit_bias) if params.logit_bias else None,
    }
    return VLLMSampling(kwargs, structured_constraint(params.structured_output))


def choice_kwargs(params: SamplingParams, index: int, num_resumed_tokens: int = 0) -> VLLMSampling:
    """Choice ``index`` as a vLLM request of its own: ``n=1``, seeded ``seed + index``, its
    token budget less the ``num_resumed_tokens`` output tokens a migrated choice already has."""
    if not 0 <= index < params.n:
        raise ValueError(f"choice {index} of a request with n={params.n}")
    if not 0 <= num_resumed_tokens < params.max_tokens:
        raise ValueError(f"{num_resumed_tokens} resumed tokens leave no room in max_tokens "
                         f"({params.max_tokens})")
    whole = sampling_kwargs(params)
    kwargs = dict(whole.kwargs)
    kwargs["n"] = 1
    if params.seed is not None:
        kwargs["seed"] = vllm_seed(params.seed + index)
    kwargs["max_tokens"] = params.max_tokens - num_resumed_tokens
    kwargs["min_tokens"] = max(0, params.min_tokens - num_resumed_tokens)
    return VLLMSampling(kwargs, whole.constraint)


def vllm_seed(seed: int | None) -> int | None:
    """The seed vLLM gets: the same torch generator seed, never vLLM's -1 ("unseeded")."""
    return None if seed is None else seed % SEED_MODULUS


def structured_constraint(spec: StructuredOutput | None) -> dict[str, Any] | None:
    """Keyword arguments of vLLM's ``StructuredOutputsParams`` / ``GuidedDecodingParams``.

    fairserve has JSON object and JSON schema outputs (OpenAI's ``response_format``) and forced
    tool calls (a Lark grammar); vLLM's regex and choice constraints have no fairserve request
    field. The schema goes as
    a parsed object so text that is not a JSON object is refused here, naming the field.
    """
    if spec is None:
        return None
    if spec.kind is GuideKind.JSON_OBJECT:
        return {"json_object": True}
    if spec.kind in (GuideKind.TOOL_CALLS, GuideKind.TOOL_CALL_BLOCKS):
        # a forced tool call: the Lark grammar llguidance takes (vLLM's `guidance` backend;
        try:  # untested here)
            return {"grammar": grammar_for(spec.kind.value, spec.schema)}
        except GrammarError as exc:
            raise InvalidRequestError(f"tools: {exc}", "tools") from exc
    try:
        schema = json.loads(spec.schema)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"response_format: the JSON schema is not valid JSON ({exc})",
                                  "response_format") from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format: the JSON schema must be a JSON object",
                                  "response_format")
    return {"json": schema}
