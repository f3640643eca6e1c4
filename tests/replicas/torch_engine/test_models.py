"""Tiny random-weight models of each architecture against transformers' own forward pass.

The engine's path (scheduler, block manager, paged attention, chunked prefill, batched decode)
must give the same logits as transformers running the full sequence, within float tolerance.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from replicas.engine.interface import FinishReason
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.block_manager import BlockManager
from replicas.torch_engine.model_runner import CacheShape, ModelRunner
from replicas.torch_engine.models.llama import LlamaForCausalLM as EngineModel
from replicas.torch_engine.models.model_config import ModelConfig
from replicas.torch_engine.scheduler import Scheduler, SchedulerConfig
from replicas.torch_engine.sequence import Sequence
from tests.replicas.torch_engine.factories import TINY_MODEL_SHAPE

TINY = dict(vocab_size=256, **TINY_MODEL_SHAPE)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-tied-llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama-linear-rope-bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(attention_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "mistral-sliding-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=24)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
}

BLOCK_SIZE = 8


def _build(arch: str):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf_config = config_cls(**TINY, **extra)
    hf_config._attn_implementation = "eager"
    reference = model_cls(hf_config).eval()
    cfg = ModelConfig.from_hf_config(hf_config)
    model = EngineModel(cfg, max_positions=TINY["max_position_embeddings"])
    weights = {k.removeprefix("model."): v for k, v in reference.state_dict().items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    model.load_weights(weights.items())
    model.eval()
    num_blocks = 64
    cache = CacheShape(num_blocks, BLOCK_SIZE, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, cache, torch.device("cpu"), torch.float32)
    block_manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    return reference, runner, block_manager


def _reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_chunked_prefill_and_batched_decode_match_transformers(arch: str) -> None:
    reference, runner, block_manager = _build(arch)
    # A token budget of 24 splits the 40-token prompt into chunks and mixes chunks with decodes.
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8), block_manager)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 40, 17, 9)]
    seqs = [
        Sequence.from_prompt(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    for seq in seqs:
        scheduler.add(seq)
    num_compared = 0
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        logits = runner.execute(output.scheduled)
        scheduler.update_after_step(output)
        sampling = [s.seq for s in output.scheduled if s.is_sampling]
        for row, seq in enumerate(sampling):
            expected = _reference_logits(reference, seq.token_ids)
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=1e-4)
            num_compared += 1
            seq.append_token(int(expected.argmax()))  # teacher-forced on the reference
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
        block_manager.check_invariants()
    assert num_compared == 4 * 12
    assert block_manager.num_free_blocks == block_manager.num_total_blocks


def test_prefix_cache_hit_gives_same_logits() -> None:
    reference, runner, block_manager = _build("llama")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), block_manager)
    shared = list(range(10, 10 + 3 * BLOCK_SIZE))
    first = Sequence.from_prompt("a", shared + [1, 2], SamplingParams(max_tokens=1, temperature=0.0))
    second = Sequence.from_prompt("b", shared + [3], SamplingParams(max_tokens=1, temperature=0.0))
    for seq in (first, second):
        scheduler.add(seq)
        output = scheduler.schedule()
        logits = runner.execute(output.scheduled)
        scheduler.update_after_step(output)
        torch.testing.assert_close(logits[0], _reference_logits(reference, seq.token_ids), atol=2e-4, rtol=1e-4)
        scheduler.finish(seq, FinishReason.LENGTH)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * BLOCK_SIZE
    assert block_manager.num_free_blocks == block_manager.num_total_blocks
