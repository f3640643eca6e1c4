"""LoRA adapters on the torch engine (replicas/torch_engine/lora.py), with adapters built here:
random weights saved in PEFT's format (adapter_config.json + adapter_model.safetensors), on the default
model. Nothing is downloaded.

- exactness: greedy, an adapter gives the tokens of a float32 model with it merged into the
  weights (and not the base model's);
- batch invariance: one step mixing three adapters and the base model (the default path: the CPU
  kernels, bfloat16 where native, int4) gives each request the tokens it gets alone;
- the prefix cache is partitioned per adapter; the cache of loaded adapters is an LRU;
- a bad adapter is refused naming the file and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from replicas.engine.config import DType, EngineConfig, default_model_path
from replicas.engine.errors import InvalidRequestError
from replicas.engine.interface import Chunk, GenerateRequest
from replicas.engine.lora_files import check_adapter_dir
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.engine_core import EngineCore
from replicas.torch_engine.loader import ModelSource, load_model_source
from replicas.torch_engine.lora import (
    AdapterCache,
    AdapterError,
    _fused,
    load_adapter,
    write_random_adapter,
)
from replicas.torch_engine.models.model_config import ModelConfig

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 16
PROMPTS = ("Write a short story about a lighthouse.", "Name three primary colors.",
           "Explain why the sky is blue.", "Give me a recipe for bread.")
@pytest.fixture(scope="module")
def source() -> ModelSource:
    return load_model_source(default_model_path())


@pytest.fixture(scope="module")
def adapters(source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"tone-a": write_random_adapter(root / "a", source.config, 8, 1),
            "tone-b": write_random_adapter(root / "b", source.config, 16, 2),
            "attn-only": write_random_adapter(root / "c", source.config, 4, 3,
                                       ("q_proj", "k_proj", "v_proj", "o_proj"))}


def _run(core: EngineCore, requests: list[GenerateRequest]) -> dict[str, list[Chunk]]:
    chunks: dict[str, list[Chunk]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add(core.prepare(request))
    while core.has_unfinished:
        for chunk in core.step():
            chunks[chunk.request_id].append(chunk)
    return chunks


def _request(rid: str, core: EngineCore, prompt: str, adapter: str | None) -> GenerateRequest:
    ids = core.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return GenerateRequest(rid, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0,
                                               ignore_eos=True),
                           prompt_token_ids=tuple(ids), adapter=adapter)


def _tokens(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _merged(weights: Mapping[str, torch.Tensor], adapter_dir: Path, cfg: ModelConfig
            ) -> dict[str, torch.Tensor]:
    """The model's weights (named as ``ModelSource.weights`` names them:
    ``layers.<i>.self_attn.q_proj.weight``, ...) with an adapter merged in (W + s B A, in
    float32): the reference the per-row update is held to."""
    adapter = load_adapter(adapter_dir, cfg, "merged")
    merged = {k: v.float().clone() for k, v in weights.items()}
    inverse = {(p, s): m for m, (p, s, _) in _fused(cfg).items()}
    for layer, projections in enumerate(adapter.layers):
        for projection, updates in projections.items():
            for u in updates:
                module = inverse[(projection, u.start)]
                part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                merged[f"layers.{layer}.{part}.{module}.weight"] += u.b @ u.a
    return merged


def test_an_adapter_gives_the_tokens_of_its_weights_merged(source, adapters) -> None:
    config = EngineConfig(dtype=DType.FLOAT32, cpu_kernels=False, max_num_seqs=8,
                          lora_adapters={n: str(p) for n, p in adapters.items()})
    core = EngineCore(config, source=source)
    for name, path in adapters.items():
        merged_weights = _merged(dict(source.weights()), path, source.config)
        merged = ModelSource(source.path, source.config, lambda w=merged_weights: iter(w.items()),
                             source.tokenizer)
        reference = EngineCore(EngineConfig(dtype=DType.FLOAT32, cpu_kernels=False,
                                            max_num_seqs=8), source=merged)
        changed = 0
        for i, prompt in enumerate(PROMPTS[:2]):
            with_adapter = _tokens(_run(core, [_request(f"{name}{i}", core, prompt,
                                                        name)])[f"{name}{i}"])
            expected = _tokens(_run(reference, [_request("m", reference, prompt, None)])["m"])
            base = _tokens(_run(core, [_request("b", core, prompt, None)])["b"])
            assert with_adapter == expected, (name, prompt)
            changed += with_adapter != base
        assert changed, name  # the adapter does change the output


def test_one_step_mixing_three_adapters_and_the_base_gives_each_its_tokens_alone(
        source, adapters) -> None:
    # the default path: CPU kernels, bfloat16 where native, int4 for the default model
    config = EngineConfig(max_num_seqs=16, lora_adapters={n: str(p) for n, p in adapters.items()})
    core = EngineCore(config, source=source)
    plan = [(f"r{i}", PROMPTS[i % len(PROMPTS)], adapter)
            for i, adapter in enumerate([None, "tone-a", "tone-b", "attn-only", "tone-a", None,
                                         "tone-b", "attn-only"])]
    alone = {rid: _tokens(_run(core, [_request(rid, core, prompt, adapter)])[rid])
             for rid, prompt, adapter in plan}
    together = _run(core, [_request(rid, core, prompt, adapter)
                           for rid, prompt, adapter in plan])
    assert {rid: _tokens(chunks) for rid, chunks in together.items()} == alone
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in alone.values())
    # same prompt, another adapter: another text
    assert alone["r0"] != alone["r4"] and alone["r1"] != alone["r5"]
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_the_prefix_cache_is_partitioned_per_adapter(source, adapters) -> None:
    config = EngineConfig(max_num_seqs=8, lora_adapters={n: str(p) for n, p in adapters.items()})
    core = EngineCore(config, source=source)
    prompt = "Summarize the history of the printing press in three sentences, please. " * 3

    def cached(rid: str, adapter: str | None) -> int:
        chunks = _run(core, [_request(rid, core, prompt, adapter)])[rid]
        usage = chunks[-1].usage
        assert usage is not None
        return usage.num_cached_tokens

    assert cached("a1", "tone-a") == 0
    assert cached("a2", "tone-a") > 0  # the same adapter shares its blocks
    assert cached("b1", "tone-b") == 0  # another adapter's KV is not this one's
    assert cached("base", None) == 0


def test_loaded_adapters_are_an_lru_of_max_loras(source, adapters) -> None:
    cache = AdapterCache(adapters, source.config, max_loras=2)
    for name in ("tone-a", "tone-b", "tone-a", "attn-only"):
        cache.get(name)
    assert cache.loaded == ["tone-a", "attn-only"] and cache.num_loads == 3
    cache.get("tone-b")  # evicted: loaded again
    assert cache.loaded == ["attn-only", "tone-b"] and cache.num_loads == 4
    adapter = cache.get("tone-b")
    assert adapter.rank == 16 and adapter.num_bytes > 0
    with pytest.raises(AdapterError, match="no adapter 'nope'"):
        cache.get("nope")


def test_a_bad_adapter_is_refused_naming_the_file_and_the_field(source, adapters,
                                                                tmp_path) -> None:
    cfg = source.config
    config_file = adapters["tone-a"] / "adapter_config.json"
    # what the engine says on loading it, and what `fairserve adapters add` says from its
    # files alone (lora_files.check_adapter_dir, no torch, no model)
    for name, change, match, files_match in (
            ("rank", {"r": 4}, r"adapter_model.safetensors: layer 0 down_proj: lora_A "
                              r"\(8, 1536\) and lora_B \(576, 8\), expected \(4, 1536\)",
             r"model.layers.0.mlp.down_proj.lora_A.weight' has shape \[8, 1536\]; lora_A "
             r"of rank 4"),
            ("dora", {"use_dora": True}, "use_dora=True is not supported", None),
            ("type", {"peft_type": "IA3"}, "peft_type 'IA3' is not LORA", None)):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes(
            (adapters["tone-a"] / "adapter_model.safetensors").read_bytes())
        (bad / "adapter_config.json").write_text(json.dumps(
            {**json.loads(config_file.read_text()), **change}))
        with pytest.raises(AdapterError, match=match):
            load_adapter(bad, cfg, name)
        with pytest.raises(AdapterError, match=files_match or match):
            check_adapter_dir(bad, name)
    with pytest.raises(AdapterError, match="cannot read .*adapter_config.json"):
        load_adapter(tmp_path / "missing", cfg, "missing")
    files = check_adapter_dir(adapters["attn-only"], "attn-only")
    assert (files.rank, files.modules, files.num_layers) == (
        4, {"q_proj", "k_proj", "v_proj", "o_proj"}, cfg.num_layers)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text(config_file.read_text())
    (truncated / "adapter_model.safetensors").write_bytes(b"\x08\x00")
    with pytest.raises(AdapterError, match="cannot read .*adapter_model.safetensors"):
        check_adapter_dir(truncated, "truncated")
    core = EngineCore(EngineConfig(max_num_seqs=4), source=source)
    with pytest.raises(InvalidRequestError, match="no adapter 'tone-z'") as err:
        core.add(core.prepare(_request("z", core, "Hi", "tone-z")))
    assert err.value.param == "model"


def test_the_cpu_kernel_adds_the_update_of_the_torch_ops_batch_invariantly(source,
                                                                           adapters) -> None:
    """``lora_apply`` (kernels/cpu_ops.cpp) against the torch ops, on every projection of a
    layer, float32 and bfloat16; a row's bits do not depend on the rows beside it."""
    import torch

    from replicas.torch_engine.kernels import cpu_ops
    from replicas.torch_engine.lora import LoraBatch, LoraStacks

    if not cpu_ops().is_available:
        pytest.skip(f"no CPU kernels here: {cpu_ops().detail}")
    loaded = {n: load_adapter(p, source.config, n) for n, p in adapters.items()}
    rows = [loaded["tone-a"], None, loaded["tone-b"], loaded["tone-a"], loaded["attn-only"],
            loaded["tone-b"]]
    cfg = source.config
    widths = {"qkv": (cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
              "o": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
              "down": (cfg.intermediate_size, cfg.hidden_size)}
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for projection, (width_in, width_out) in widths.items():
            x = torch.randn(len(rows), width_in, generator=generator).to(dtype)
            y = torch.randn(len(rows), width_out, generator=generator).to(dtype)
            by_kernel, by_ops = y.clone(), y.clone()
            LoraBatch.of_rows(rows, x.device, LoraStacks(), use_kernel=True).apply(
                3, projection, x, by_kernel)
            LoraBatch.of_rows(rows, x.device, LoraStacks(), use_kernel=False).apply(
                3, projection, x, by_ops)
            assert not torch.equal(by_kernel, y), projection  # the update is there
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(by_kernel.float(), by_ops.float(), rtol=tolerance,
                                       atol=tolerance)
            for i in range(len(rows)):  # each row alone: the same bits
                alone = y[i:i + 1].clone()
                batch = LoraBatch.of_rows(rows[i:i + 1], x.device, LoraStacks(), use_kernel=True)
                if batch is not None:  # None: a row of the base model
                    batch.apply(3, projection, x[i:i + 1], alone)
                assert torch.equal(alone[0], by_kernel[i]), (projection, dtype, i)
