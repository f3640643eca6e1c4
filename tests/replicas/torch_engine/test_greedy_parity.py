"""Greedy output of the engine against transformers' generation, on SmolLM2-135M-Instruct.

Eight chat prompts of different lengths (several longer than one prefill chunk) run one at a
time, all together, again with prefix-cache hits, and with preemption forced by a tiny KV
budget. Every token must equal the reference's, except where float rounding between batch
shapes flips a near-tie: then the engine's token must be the reference's runner-up with a
logit gap under 1e-3, and the case is reported as a warning. Anything else is a bug.
"""

from __future__ import annotations

import pytest
import torch

from replicas.engine.config import DType, EngineConfig, default_model_path
from replicas.engine.interface import Chunk, GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.engine_core import EngineCore
from replicas.torch_engine.loader import ModelSource, load_model_source
from tests.replicas.torch_engine.factories import Reference, check_greedy_tokens, hf_reference_model

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 24
CHUNK_TOKENS = 64  # the token budget: prompts longer than this are prefilled in chunks

LONG_TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread "
    "to Europe and North America. It replaced hand tools with machines, brought steam power to "
    "factories and railways, and moved millions of people from farms into growing cities. "
    "Historians still debate why it started in Britain: coal and iron close together, a large "
    "colonial market, secure property rights, high wages that made labour-saving machines pay, "
    "and a culture of practical tinkering all played a part. "
)

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Summarize this text in one sentence: " + LONG_TEXT,
    "List the causes mentioned here, as bullet points: " + LONG_TEXT * 2,
    "Give a title to this passage and explain your choice: " + LONG_TEXT * 3,
]


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return load_model_source(default_model_path())


@pytest.fixture(scope="module")
def prompt_ids(source: ModelSource) -> list[list[int]]:
    ids = [source.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    assert sum(len(p) > CHUNK_TOKENS for p in ids) >= 3, [len(p) for p in ids]
    return ids


@pytest.fixture(scope="module")
def references(source: ModelSource, prompt_ids: list[list[int]]) -> list[Reference]:
    """transformers' greedy generation, one prompt at a time, on the same weights."""
    model = hf_reference_model(source)
    eos = list(source.tokenizer.eos_token_ids)
    refs = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(ids) :].tolist()
        refs.append(Reference(tokens, [step[0].float() for step in out.logits]))
    return refs


def _engine(source: ModelSource, **overrides) -> EngineCore:
    # float32: the parity with transformers is the float32 path's test
    config = EngineConfig(max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=16,
                          dtype=DType.FLOAT32, **overrides)
    return EngineCore(config, source=source)


def _run(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, list[Chunk]]:
    chunks: dict[str, list[Chunk]] = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        core.add(core.prepare(GenerateRequest(rid, params, prompt_token_ids=tuple(ids))))
    while core.has_unfinished:
        for chunk in core.step():
            chunks[chunk.request_id].append(chunk)
        core.block_manager.check_invariants()
    return chunks


def _tokens(chunks: list[Chunk]) -> list[int]:
    assert chunks and chunks[-1].is_final
    return [t for c in chunks for t in c.token_ids]


def test_greedy_one_at_a_time(source, prompt_ids, references) -> None:
    core = _engine(source, enable_prefix_caching=False)
    for i, ids in enumerate(prompt_ids):
        out = _run(core, {f"r{i}": ids})
        check_greedy_tokens("one at a time", i, references[i], _tokens(out[f"r{i}"]))
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_greedy_all_in_one_batch_then_with_prefix_cache_hits(source, prompt_ids, references) -> None:
    core = _engine(source)
    prompts = {f"r{i}": ids for i, ids in enumerate(prompt_ids)}
    first = _run(core, prompts)
    for i in range(len(prompt_ids)):
        check_greedy_tokens("batched", i, references[i], _tokens(first[f"r{i}"]))
    # Same prompts again: every full prompt block comes from the prefix cache.
    second = _run(core, {f"again{i}": ids for i, ids in enumerate(prompt_ids)})
    for i, ids in enumerate(prompt_ids):
        chunks = second[f"again{i}"]
        check_greedy_tokens("prefix-cache hits", i, references[i], _tokens(chunks))
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_greedy_under_preemption(source, prompt_ids, references) -> None:
    longest = max(len(p) for p in prompt_ids) + MAX_NEW_TOKENS
    num_blocks = -(-longest // 16) + 4  # the longest request fits alone, the batch does not
    core = _engine(source, num_kv_blocks=num_blocks)
    out = _run(core, {f"r{i}": ids for i, ids in enumerate(prompt_ids)})
    preemptions = 0
    for i in range(len(prompt_ids)):
        chunks = out[f"r{i}"]
        check_greedy_tokens("preemption", i, references[i], _tokens(chunks))
        timings = chunks[-1].timings
        assert timings is not None
        preemptions += timings.num_preemptions
    assert preemptions > 0, "the tiny KV budget should have forced preemption"
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_capital_of_france(source) -> None:
    core = _engine(source)
    request = GenerateRequest(
        "paris",
        SamplingParams(max_tokens=20, temperature=0.0),
        messages=({"role": "user", "content": "Which city is the capital of France?"},),
    )
    core.add(core.prepare(request))
    chunks: list[Chunk] = []
    while core.has_unfinished:
        chunks.extend(core.step())
    assert "".join(c.text for c in chunks) == "The capital of France is Paris."
    assert chunks[-1].finish_reason.value == "stop"
