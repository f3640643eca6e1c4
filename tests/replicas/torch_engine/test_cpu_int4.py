"""Weight-only int4 layers (replicas/torch_engine/models/cpu_int4.py): a Q4_1-style block comes
back as its own codes, the layer computes the dequantized product, and a row's result does not depend
on the rows beside it; and where ``quantization: auto`` picks int4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from replicas.engine.config import DType, EngineConfig, Quantization
from replicas.torch_engine.device_choice import ComputeChoice, resolve_quantization
from replicas.torch_engine.loader.gguf_loader import layer_weight_bits, tensor_types
from replicas.torch_engine.models.cpu_int4 import (
    GROUP_SIZE,
    Int4Linear,
    can_quantize,
    quantize_groups,
)

CPU = torch.device("cpu")


def q4_1_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as a Q4_1 file dequantizes them (d * q + m per group of 32, codes 0..15 with
    both ends used), and their codes."""
    torch.manual_seed(out_features)
    groups = in_features // GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, groups, GROUP_SIZE))
    codes[..., 0], codes[..., 1] = 0, 15
    d = torch.rand(out_features, groups, 1).half().float() * 0.02 + 1e-3
    m = -torch.rand(out_features, groups, 1).half().float() * 0.1
    return (codes * d + m).view(out_features, in_features), codes.view(out_features, in_features)


def test_a_q4_1_block_is_quantized_back_to_its_codes() -> None:
    weight, codes = q4_1_weight(64, 576)
    got, _, _ = quantize_groups(weight)
    assert torch.equal(got, codes.to(torch.int32))


@pytest.mark.skipif(not can_quantize(nn.Linear(64, 16)), reason="torch has no CPU int4 kernel")
def test_int4_linear_computes_the_dequantized_product_row_by_row() -> None:
    weight, _ = q4_1_weight(960, 576)
    layer = Int4Linear(weight, None)
    x = torch.randn(40, 576).bfloat16()
    full = layer(x)
    expected = x.float() @ weight.t()
    # the only loss: bfloat16 scale and zero, bfloat16 output
    torch.testing.assert_close(full.float(), expected, rtol=2e-2, atol=2e-2)
    for start, rows in ((0, 1), (7, 1), (3, 16), (5, 33)):
        assert torch.equal(layer(x[start:start + rows]), full[start:start + rows])


def _choice(dtype: DType, kernels: bool = True, device: str = "cpu") -> ComputeChoice:
    return ComputeChoice(torch.device(device), dtype, "test", kernels)


def test_auto_picks_int4_only_for_a_4_bit_file_on_a_bfloat16_cpu_engine() -> None:
    auto = Quantization.AUTO
    assert resolve_quantization(auto, _choice(DType.BFLOAT16), 4)[0] is Quantization.INT4
    for choice, bits in ((_choice(DType.BFLOAT16), 8), (_choice(DType.BFLOAT16), None),
                         (_choice(DType.FLOAT32), 4), (_choice(DType.BFLOAT16, False), 4),
                         (_choice(DType.BFLOAT16, device="cuda"), 4)):
        quantization, reason = resolve_quantization(auto, choice, bits)
        assert quantization is Quantization.NONE and reason
    assert resolve_quantization(Quantization.NONE, _choice(DType.BFLOAT16), 4)[0] is Quantization.NONE


def test_int4_asked_where_it_cannot_run_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="quantization int4 needs a CPU engine in bfloat16 with"):
        resolve_quantization(Quantization.INT4, _choice(DType.FLOAT32), 4)
    quantization, _ = resolve_quantization(Quantization.INT4, _choice(DType.BFLOAT16), 16)
    assert quantization is Quantization.INT4


def test_the_default_model_file_is_4_bit() -> None:
    assert layer_weight_bits(EngineConfig().model) == 4


def test_the_header_scan_reads_what_the_gguf_reader_reads(tmp_path) -> None:
    import gguf

    path = EngineConfig().model
    reader = gguf.GGUFReader(path, "r")
    assert tensor_types(path) == [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type))
                                  for t in reader.tensors]
    # a file that is not a whole GGUF header: no answer, never a wrong one
    with open(path, "rb") as file:
        whole = file.read(200_000)
    for i, content in enumerate([b"", b"GGUF", b"GGUF\x03\0\0\0" + b"\xff" * 16, whole[:5_000],
                                 whole[:150_000], b"GGML" + whole[4:]]):
        broken = tmp_path / f"broken-{i}.gguf"
        broken.write_bytes(content)
        assert layer_weight_bits(str(broken)) is None, i


@pytest.mark.skipif(not can_quantize(nn.Linear(64, 16)), reason="torch has no CPU int4 kernel")
def test_split_linear_computes_generated_rows_in_int4_and_prompt_rows_dense() -> None:
    from replicas.torch_engine.models.cpu_int4 import SplitLinear
    from replicas.torch_engine.models.cpu_linear import BF16_PROMPT_ROW_TILE, pack_linears

    weight, _ = q4_1_weight(576, 576)
    linear = nn.Linear(576, 576, bias=False)
    linear.weight.data = weight
    split = SplitLinear(linear)
    split.dense.to(torch.bfloat16)
    assert pack_linears(nn.Sequential(split)) == 1  # as pack_for_cpu leaves it
    assert split.dense.row_tile == BF16_PROMPT_ROW_TILE  # prompt rows only: the larger tile
    x = torch.randn(21, 576).bfloat16()
    for num_generated in (0, 1, 5, 21):
        out = split(x, num_generated)
        assert torch.equal(out[:num_generated], split.int4(x[:num_generated]))
        assert torch.equal(out[num_generated:], split.dense(x[num_generated:]))
    # the two weights differ in their rounding, not in what they compute
    torch.testing.assert_close(split(x, 21).float(), split(x, 0).float(), rtol=3e-2, atol=3e-2)


def test_int4_set_where_it_cannot_run_is_refused_when_the_settings_are_read() -> None:
    for bad, named in (({"dtype": "float32"}, "dtype is float32"),
                       ({"device": "cuda"}, "device is cuda"),
                       ({"cpu_kernels": False}, "cpu_kernels is false")):
        with pytest.raises(ValueError, match=named):
            EngineConfig(quantization="int4", **bad)
    assert EngineConfig(quantization="int4").quantization is Quantization.INT4
