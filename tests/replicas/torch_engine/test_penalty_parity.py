"""Penalties on the real model: greedy output with repetition, frequency and presence
penalties equals transformers' generation with its own ``RepetitionPenaltyLogitsProcessor`` and
the frequency/presence formula vLLM documents as a logits processor, and differs from the
unpenalised output. The prompts invite repetition, so the penalties have something to do."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from replicas.engine.config import DType, EngineConfig, default_model_path
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.engine_core import EngineCore
from replicas.torch_engine.loader import ModelSource, load_model_source
from tests.replicas.torch_engine.factories import Reference, check_greedy_tokens, hf_reference_model

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
PROMPTS = [
    "Repeat the word 'banana' twenty times.",
    "List the numbers from one to thirty in words, separated by commas.",
    "Write a poem where every line starts with 'The sea'.",
]
CASES = {
    "repetition": {"repetition_penalty": 1.3},
    "frequency": {"frequency_penalty": 1.2},
    "presence": {"presence_penalty": 1.5},
    "all": {"repetition_penalty": 1.15, "frequency_penalty": 0.6, "presence_penalty": 0.4},
}


class FrequencyPresence(LogitsProcessor):
    """vLLM's formula: logits -= frequency * count + presence * (count > 0), output only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        output = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return load_model_source(default_model_path())


@pytest.fixture(scope="module")
def prompts(source: ModelSource) -> list[list[int]]:
    return [source.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            for p in PROMPTS]


def reference(model, source: ModelSource, ids: list[int], penalties: dict[str, float]) -> Reference:
    eos = list(source.tokenizer.eos_token_ids)
    processors = LogitsProcessorList([FrequencyPresence(
        len(ids), penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0))])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
            repetition_penalty=penalties.get("repetition_penalty", 1.0),
            logits_processor=processors, output_logits=True, return_dict_in_generate=True)
    return Reference(out.sequences[0, len(ids):].tolist(), [s[0].float() for s in out.logits])


def engine_tokens(core: EngineCore, prompts: list[list[int]], penalties: dict[str, float],
                  tag: str) -> list[list[int]]:
    """All prompts in one batch (the penalties are applied to the batch at once)."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, **penalties)
        core.add(core.prepare(GenerateRequest(f"{tag}{i}", params, prompt_token_ids=tuple(ids))))
    tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while core.has_unfinished:
        for chunk in core.step():
            tokens[chunk.request_id].extend(chunk.token_ids)
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))]


def test_penalised_greedy_output_equals_transformers_and_differs_from_plain(
        source, prompts) -> None:
    model = hf_reference_model(source)
    core = EngineCore(EngineConfig(max_num_seqs=8, dtype=DType.FLOAT32), source=source)
    plain = engine_tokens(core, prompts, {}, "plain")
    for case, penalties in CASES.items():
        got = engine_tokens(core, prompts, penalties, case)
        for i, ids in enumerate(prompts):
            check_greedy_tokens(case, i, reference(model, source, ids, penalties), got[i])
        assert got != plain, f"{case}: the penalties changed nothing"
