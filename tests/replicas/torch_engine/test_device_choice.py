"""``device: auto`` and ``dtype: auto`` (replicas/torch_engine/device_choice.py), and the KV budget
(replicas/torch_engine/kv_budget.py): the choice per machine, and on this machine the choice its
CPU flags call for."""

from __future__ import annotations

import subprocess

import pytest
import torch

from replicas.engine.config import DType, EngineConfig
from replicas.torch_engine import kernels
from replicas.torch_engine.device_choice import choose, cpu_flags, resolve_device, resolve_dtype
from replicas.torch_engine.kv_budget import (
    DEFAULT_CPU_KV_BYTES,
    activation_reserve_bytes,
    gpu_kv_budget,
    kv_cache_bytes,
)
from replicas.torch_engine.models.model_config import ModelConfig

CPU = torch.device("cpu")
GIB = 1024**3


def test_auto_on_a_cpu_is_bfloat16_where_native_and_the_kernels_run() -> None:
    for flags in ({"avx2", "avx512f", "avx512_bf16"}, {"avx2", "amx_bf16", "amx_tile"}):
        dtype, reason = resolve_dtype(DType.AUTO, CPU, frozenset(flags), has_cpu_kernels=True)
        assert dtype is DType.BFLOAT16 and "natively" in reason and "kernels" in reason
        # without the kernels only float32 keeps a resumed request's text
        dtype, reason = resolve_dtype(DType.AUTO, CPU, frozenset(flags), has_cpu_kernels=False)
        assert dtype is DType.FLOAT32 and "natively" in reason and "dtype: bfloat16" in reason
    for has_kernels in (True, False):
        dtype, reason = resolve_dtype(DType.AUTO, CPU, frozenset({"avx2", "avx512f", "avx512bw"}),
                                      has_cpu_kernels=has_kernels)
        assert dtype is DType.FLOAT32 and "no native bfloat16" in reason
        assert resolve_dtype(DType.AUTO, CPU, frozenset(), has_kernels)[0] is DType.FLOAT32


def test_a_set_dtype_is_kept_whatever_the_machine() -> None:
    for dtype in (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16):
        assert resolve_dtype(dtype, CPU, frozenset({"amx_bf16"}))[0] is dtype
        assert resolve_dtype(dtype, CPU, frozenset())[0] is dtype


def test_cpu_flags_reads_the_first_flags_line(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n"
                    "flags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_on_this_machine_auto_follows_lscpu() -> None:
    flags = set(subprocess.run(["lscpu"], capture_output=True, text=True, check=True)
                .stdout.split())
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    choice = choose(EngineConfig())
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert choice.device.type == expected_device
    if expected_device == "cpu":
        # g++ and ninja are on this machine (make install checks): the kernels must build
        assert choice.uses_cpu_kernels, kernels.cpu_ops().detail
        assert choice.dtype is (DType.BFLOAT16 if native else DType.FLOAT32)
        assert ("natively" in choice.reason) is native, choice.reason
        off = choose(EngineConfig(cpu_kernels=False))
        assert not off.uses_cpu_kernels and off.dtype is DType.FLOAT32


def test_devices() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="gpu")


def _model() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       sliding_window=None, rope_theta=100000.0)


def test_gpu_budget_is_what_the_fraction_leaves_after_weights_and_activations() -> None:
    assert gpu_kv_budget(140 * GIB, 10 * GIB, 0.9, 2 * GIB) == int(140 * GIB * 0.9) - 12 * GIB
    with pytest.raises(ValueError, match=r"no GPU memory left for the KV cache: 0\.50 x 16\.0 GiB"):
        gpu_kv_budget(16 * GIB, 7 * GIB, 0.5, 2 * GIB)


def test_activation_reserve_grows_with_the_step_budget() -> None:
    small = activation_reserve_bytes(EngineConfig(max_num_batched_tokens=512), _model(), 2)
    large = activation_reserve_bytes(EngineConfig(max_num_batched_tokens=8192), _model(), 2)
    assert 0 < small < large


def test_cpu_budget_is_the_setting_or_one_gib() -> None:
    assert kv_cache_bytes(EngineConfig(), CPU, _model(), torch.float32) == DEFAULT_CPU_KV_BYTES
    assert kv_cache_bytes(EngineConfig(kv_cache_bytes=64 * 2**20), CPU, _model(),
                          torch.float32) == 64 * 2**20
