"""The engine's parameter names and shapes, and the check that a checkpoint provides them.

Names follow Hugging Face's Llama layout without the ``model.`` prefix: ``embed_tokens.weight``,
``layers.{i}.self_attn.q_proj.weight``, ..., ``norm.weight``, and ``lm_head.weight`` only when
the output projection is not tied to the embedding. Both loaders check a checkpoint's tensor
table against ``expected_weight_shapes`` before any tensor data is read, so a wrong or partial
checkpoint fails at load time, naming the file, and not halfway through filling the model.
"""

from __future__ import annotations

from collections.abc import Mapping

from replicas.engine.errors import ModelLoadError
from replicas.torch_engine.models.model_config import ModelConfig

MAX_NAMES_IN_ERROR = 8


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, and its shape (PyTorch ``(out, in)`` order)."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, hidden),
        "norm.weight": (hidden,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q_size, hidden),
            "self_attn.k_proj.weight": (kv_size, hidden),
            "self_attn.v_proj.weight": (kv_size, hidden),
            "self_attn.o_proj.weight": (hidden, q_size),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        if cfg.attention_bias:
            layer["self_attn.q_proj.bias"] = (q_size,)
            layer["self_attn.k_proj.bias"] = (kv_size,)
            layer["self_attn.v_proj.bias"] = (kv_size,)
            if cfg.architecture != "qwen2":  # Llama's attention_bias covers o_proj, Qwen2's not
                layer["self_attn.o_proj.bias"] = (hidden,)
        if cfg.mlp_bias:
            layer["mlp.gate_proj.bias"] = (inter,)
            layer["mlp.up_proj.bias"] = (inter,)
            layer["mlp.down_proj.bias"] = (hidden,)
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_weight_shapes(found: Mapping[str, tuple[int, ...]], cfg: ModelConfig, path: str) -> None:
    """Raise ModelLoadError naming ``path`` unless ``found`` has exactly the expected tensors."""
    expected = expected_weight_shapes(cfg)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors {_names(missing)}", path)
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint has unexpected tensors {_names(unexpected)}", path)
    wrong = [
        f"{name} {tuple(found[name])} (expected {shape})"
        for name, shape in expected.items()
        if tuple(found[name]) != shape
    ]
    if wrong:
        raise ModelLoadError(f"checkpoint tensors have wrong shapes: {_names(wrong)}", path)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_IN_ERROR])
    more = len(names) - MAX_NAMES_IN_ERROR
    return f"{shown} and {more} more" if more > 0 else shown
