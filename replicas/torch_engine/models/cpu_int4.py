"""Weight-only int4 linear layers for CPU decoding (``engine.quantization: int4``).

NOTE: at one sequence a decode step streams every weight once and computes little: on a 2-core
Xeon the 30 layers' bfloat16 projections take ~14 ms, at the memory's ~17 GB/s. A GGUF file
such as the default SmolLM2 Q4_1 holds those weights in 4 bits (groups of 32 with a scale and a
minimum); keeping them so reads a quarter of the bytes: 4.5 ms for the same 30 layers at 1 row
(torch's ``_weight_int4pack_mm_for_cpu``, bfloat16 activations). But the kernel does not use
AMX: it is slower than bfloat16 from ~12 rows up (22.6 vs ~16 ms at 16 rows, 43 vs ~28 at 32)
and far slower on prefill chunks of hundreds of rows. So an int4 engine keeps both: generated
tokens (decode rows, bound by reading the weights) go through int4, prompt tokens (prefill,
bound by arithmetic) through the packed bfloat16 weights (``SplitLinear``). Which weights a
token sees depends only on whether it is past its sequence's prompt, never on the batch or the
step, so a resumed request (prompt, then its sent tokens recomputed as output) and a recomputed
one rebuild exactly the KV they had; the prefix cache keys blocks of generated tokens with that
boundary (block_manager.py). The cost: both copies in memory (bfloat16 + a quarter of it).

Quantization: each group of 32 input weights of an output row maps to 4-bit codes q with
``w = (q - 8) * scale + zero`` (the kernel's form), ``scale = (max - min) / 15`` and
``zero = min + 8 * scale``. A Q4_1 block is ``d * q + m`` with its minimum at q = 0 and its
maximum at q = 15, so from the file's dequantized float32 weights this recovers the file's own
codes, and the only loss is ``scale`` and ``zero`` kept in bfloat16. The vocabulary head (the
tied embedding) stays bfloat16: it is a quarter of the bytes, and its rounding shows directly in
the logits. The kernel computes each row alone (the same bits at any row count: tested), so
fairserve's batch-invariance promise holds. Its quality against the float32 engine is measured
by ``cluster/benchmarks/quality.py`` and held to thresholds by tests.
"""

from __future__ import annotations

import torch
from torch import nn

from replicas.torch_engine.models.cpu_linear import BF16_PROMPT_ROW_TILE

GROUP_SIZE = 32
INNER_K_TILES = 2


def has_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def can_quantize(linear: nn.Module) -> bool:
    return (isinstance(linear, nn.Linear) and linear.in_features % (GROUP_SIZE * INNER_K_TILES) == 0
            and linear.out_features % 16 == 0 and has_int4_kernel())


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> codes (out, in) int32 in 0..15, scale and zero (out, in/32)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: all q = 0
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp(0, 15)
    return codes.to(torch.int32).view(out_features, in_features), scale, low + 8 * scale


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit groups of 32; x is (rows, in) bfloat16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scale, zero = quantize_groups(weight.detach())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
        # (in / 32, out, 2): the kernel's layout of per-group scale and zero
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("scale_zero", scale_zero, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed_weight, GROUP_SIZE, self.scale_zero)
        return out if self.bias is None else out + self.bias


class SplitLinear(nn.Module):
    """One projection held twice: int4 for the rows of generated tokens (decodes: one row per
    sequence, bound by reading the weights) and dense for prompt rows (prefill chunks: many
    rows, bound by arithmetic, where AMX bfloat16 is ~10x the int4 kernel). The flat batch puts
    generated-token rows first (model_runner.py), so the split is a slice. The dense copy sees
    only prompt rows, so it is packed for tiles of ``BF16_PROMPT_ROW_TILE`` rows: a prompt row
    is always computed in such a tile, whatever the chunk (batch invariance as in cpu_linear.py).
    """

    packed_row_tile = BF16_PROMPT_ROW_TILE

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.int4 = Int4Linear(linear.weight, linear.bias)
        self.dense = linear  # packed by pack_linears with the rest

    def forward(self, x: torch.Tensor, num_generated: int) -> torch.Tensor:
        # (rows, in) -> (rows, out); rows [0, num_generated) are generated tokens
        if num_generated == 0:
            return self.dense(x)
        if num_generated == x.shape[0]:
            return self.int4(x)
        return torch.cat([self.int4(x[:num_generated]), self.dense(x[num_generated:])])


def split_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` below ``module`` that the kernel takes by a ``SplitLinear``
    (from its float32 weights: call before casting the model); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if can_quantize(child):
                setattr(module, name, SplitLinear(child))
                count += 1
        else:
            count += split_linears(child)
    return count
