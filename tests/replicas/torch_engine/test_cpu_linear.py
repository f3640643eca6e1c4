"""The oneDNN-packed linear layers (replicas/torch_engine/models/cpu_linear.py): the product of a
plain linear layer, and in bfloat16 a row's result independent of the rows computed beside it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from replicas.torch_engine.models.cpu_linear import (
    BF16_PROMPT_ROW_TILE,
    BF16_ROW_TILE,
    PackedLinear,
    can_pack,
)

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="torch here has no oneDNN linear packing")

SHAPES = [(576, 1536), (1536, 576), (576, 4096)]  # (in, out): MLP up, down, a wide head


def _layer(in_features: int, out_features: int, dtype: torch.dtype, bias: bool) -> nn.Linear:
    torch.manual_seed(in_features + out_features)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_the_linear_layer(dtype: torch.dtype, bias: bool) -> None:
    for in_features, out_features in SHAPES:
        plain = _layer(in_features, out_features, dtype, bias)
        packed = PackedLinear.from_linear(plain)
        for rows in (1, 7, BF16_ROW_TILE, 70):
            x = torch.randn(rows, in_features).to(dtype)
            got, want = packed(x), plain(x)
            assert got.shape == want.shape and got.dtype == dtype
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("row_tile", [BF16_ROW_TILE, BF16_PROMPT_ROW_TILE])
def test_a_rows_result_does_not_depend_on_its_batch(row_tile: int) -> None:
    """Bit for bit, in bfloat16: every subset and order of 200 rows gives each row the same
    output, with the decode tile and the prompt tile (float32 is not tiled: see the module's
    NOTE)."""
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    for in_features, out_features in SHAPES:
        packed = PackedLinear.from_linear(_layer(in_features, out_features, dtype, False),
                                          row_tile)
        assert packed.row_tile == row_tile
        x = torch.randn(200, in_features, generator=generator).to(dtype)
        reference = torch.cat([packed(row[None]) for row in x])  # each row alone
        for rows in (2, 5, 16, 31, 33, 63, 64, 65, 100, 128, 200):
            pick = torch.randperm(200, generator=generator)[:rows]
            assert torch.equal(packed(x[pick]), reference[pick]), (dtype, rows)
