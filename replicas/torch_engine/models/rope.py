"""Rotary position embedding frequencies for a ModelConfig.

The inverse frequencies come from transformers' own RoPE init functions, so a scaled RoPE
(linear, llama3, yarn) matches the reference model bit for bit. Types whose frequencies change
with the sequence length ("dynamic") or that need per-frequency factor lists ("longrope") are
refused: the engine computes cos/sin once per position, not per step.
"""

from __future__ import annotations

import torch

from replicas.torch_engine.models.model_config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(
    cfg: ModelConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)``: inv_freq is float32 of shape (head_dim // 2,).

    cos/sin of ``position * inv_freq`` are multiplied by ``attention_scaling`` (1.0 except for
    yarn). Raises ``ValueError`` naming an unsupported rope_type.
    """
    rope_type = cfg.rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    partial = (cfg.rope_scaling or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type == "default":
        # transformers 5 has no "default" entry in ROPE_INIT_FUNCTIONS (each model class carries
        # compute_default_rope_parameters); this is the same expression as LlamaRotaryEmbedding's.
        exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.float, device=device)
        inv_freq = 1.0 / (cfg.rope_theta ** (exponent / cfg.head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg.to_hf_config(), device)
    return inv_freq.to(torch.float32), float(attention_scaling)
