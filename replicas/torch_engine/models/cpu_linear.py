"""oneDNN-packed linear layers for float32 and bfloat16 inference on CPU, batch-invariant.

NOTE: torch's ``F.linear`` on CPU calls MKL sgemm on the plain row-major weight. oneDNN's
linear with the weight reordered once into its blocked layout (what torch.compile's CPU
backend does when it freezes a model) measured 1.2-1.5x faster on this machine for the decode
batch sizes (8-64 rows) and 2x faster for the vocabulary projection, and the same for long
prefill chunks. The packed layout is opaque, so packing replaces the module: do it once,
after the weights are loaded. Results differ from MKL's only by float summation order.

NOTE: batch invariance. oneDNN picks its kernel and blocking by the number of rows, so the
same row gives results differing in the last bit when it is computed among 1, 16 or 33 rows
(measured: a few elements of a layer's output, hundreds of the vocabulary head's). In bfloat16
those bits flip greedy choices: 12 of 16 greedy requests gave another text run together than
run alone. Everything fairserve promises about a request's text (a migrated request resumes
to the text it would have had; a seeded request is reproducible) needs a row's result not to
depend on its neighbours. So every bfloat16 call here has exactly ``BF16_ROW_TILE`` rows: the
batch is cut into tiles and the last is padded with zeros; each row is then computed by the
same kernel whatever the batch (0 of 16 texts differ). The tile is a trade: the weights are
streamed once per tile, so a small tile makes a lone request fast and a full batch slower. Measured
on a 2-core Xeon with AMX, a whole bfloat16 engine step (with the CPU kernels): 16-row tiles
21.9 ms at 1 sequence and 52.9 ms at 32; 32-row tiles 24.5 and 44.3 ms. 16 is chosen: one
stream is what every user of ``make up`` sees first, and 32 streams stay well ahead of llama.cpp
either way (README, CPU speed). float32 calls are not tiled: its last-bit differences have not
flipped a greedy choice in any test, and tiles cost it a third of its speed.

NOTE: the prompt tile. An int4 engine (cpu_int4.SplitLinear) computes prompt rows apart from
generated ones, in a bfloat16 copy of its own; only prefill chunks reach it, so it is packed
for ``BF16_PROMPT_ROW_TILE`` = 64 rows. At 16-row tiles a chunk streams every weight once per
16 rows and is bound by memory: measured on the 2-core Xeon (AMX), the 30 layers' projections
of a 100-token chunk 74 ms at 16-row tiles, 35 at 64, 32 at 128; of 512 tokens 264, 138, 109.
A whole engine: a lone 100-token prompt's first token 105 -> 75 ms (128 rows: 70), 16 prompts
of 100 at once all answered in 1.82 -> 1.24 s; a 20-token prompt 36 -> 31 ms (128 rows: 42,
the padding's arithmetic). Every prompt row meets the same 64-row kernel whatever its chunk,
so batch invariance holds as above (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BF16_ROW_TILE = 16
# prompt rows of an int4 engine (cpu_int4.SplitLinear): only ever prefill chunks, many rows
BF16_PROMPT_ROW_TILE = 64


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout; x must be 2-D."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 row_tile: int = BF16_ROW_TILE) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.row_tile = row_tile if weight.dtype == torch.bfloat16 else None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                         self.row_tile or 64)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, row_tile: int = BF16_ROW_TILE) -> PackedLinear:
        return cls(linear.weight, linear.bias, row_tile)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (num_tokens, in_features) -> (num_tokens, out_features), row_tile rows per call
        num_rows, tile = x.shape[0], self.row_tile
        if tile is None:
            return self._call(x.contiguous())
        pad = -num_rows % tile
        x = F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()
        if x.shape[0] == tile:
            return self._call(x)[:num_rows]
        return torch.cat([self._call(part) for part in x.split(tile)])[:num_rows]

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(module: nn.Module, row_tile: int = BF16_ROW_TILE) -> int:
    """Replace every ``nn.Linear`` below ``module`` by a ``PackedLinear``; returns how many. A
    module with a ``packed_row_tile`` attribute has the linears below it packed for that tile."""
    row_tile = getattr(module, "packed_row_tile", row_tile)
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear.from_linear(child, row_tile))
            count += 1
        else:
            count += pack_linears(child, row_tile)
    return count
