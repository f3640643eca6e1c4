"""The shape of a decoder model, independent of where its weights come from.

``ModelConfig`` is what the engine's model code reads: one frozen record that a GGUF file's
metadata and a Hugging Face ``config.json`` both reduce to. This module owns the mapping from
(and back to) transformers' config objects for the supported architectures: Llama, Mistral and
Qwen2, all pre-norm decoders with RMSNorm, rotary positions, grouped-query attention and a
SiLU-gated MLP.

NOTE: transformers 5 keeps RoPE settings in one ``config.rope_parameters`` dict
(``{"rope_type": ..., "rope_theta": ..., "factor": ...}``); transformers 4 kept ``rope_theta``
and ``rope_scaling`` as two attributes, and older configs spell ``rope_type`` as ``type``. Here
``rope_theta`` is its own field and ``rope_scaling`` holds the rest of the dict in
transformers' form, or ``None`` for plain RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Dimensions and options of a Llama-family decoder."""

    architecture: str  # "llama", "mistral" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and, for Llama's ``attention_bias``, o) projections have a bias
    mlp_bias: bool
    sliding_window: int | None  # recorded for Mistral; the engine attends to the full context
    rope_theta: float
    # transformers' form without rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        """See the module-level ``from_hf_config``."""
        return from_hf_config(hf_config)

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return str(self.rope_scaling.get("rope_type", "default"))

    def to_hf_config(self) -> Any:
        """The equivalent transformers ``LlamaConfig``, ``MistralConfig`` or ``Qwen2Config``."""
        import transformers

        kwargs: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_for_hf(self.eos_token_ids),
            "hidden_act": "silu",
            **_rope_kwargs_for_hf(self.rope_theta, self.rope_scaling),
        }
        if self.architecture == "llama":
            return transformers.LlamaConfig(
                attention_bias=self.attention_bias, mlp_bias=self.mlp_bias, **kwargs
            )
        if self.architecture == "mistral":
            return transformers.MistralConfig(sliding_window=self.sliding_window, **kwargs)
        if self.head_dim == self.hidden_size // self.num_heads:
            del kwargs["head_dim"]  # Qwen2Config has no head_dim field; it derives it
        return transformers.Qwen2Config(
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            max_window_layers=0,  # every layer slides when sliding_window is set
            **kwargs,
        )


def from_hf_config(hf_config: Any) -> ModelConfig:
    """Reduce a transformers ``LlamaConfig``/``MistralConfig``/``Qwen2Config`` to a ModelConfig.

    Raises ``ValueError`` naming what is unsupported (another architecture, a non-SiLU MLP,
    per-layer sliding windows or per-layer RoPE).
    """
    architecture = getattr(hf_config, "model_type", None)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model_type {architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
        )
    hidden_act = getattr(hf_config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    num_heads = int(hf_config.num_attention_heads)
    hidden_size = int(hf_config.hidden_size)
    rope_theta, rope_scaling = rope_from_hf_config(hf_config)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hidden_size // num_heads),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no config flag for them
        attention_bias=architecture == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        sliding_window=_sliding_window(hf_config, architecture),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=normalize_token_ids(getattr(hf_config, "eos_token_id", None)),
    )


def rope_from_hf_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either transformers 5's or 4's attributes."""
    parameters = getattr(hf_config, "rope_parameters", None)
    if isinstance(parameters, dict) and parameters:
        if any(isinstance(value, dict) for value in parameters.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {parameters}")
        theta = parameters.get("rope_theta")
        if theta is None:
            theta = getattr(hf_config, "rope_theta", None)
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    return float(theta if theta is not None else DEFAULT_ROPE_THETA), normalize_rope_scaling(
        scaling
    )


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Spell the type as ``rope_type``; plain RoPE (no type, or "default") becomes ``None``."""
    if not scaling:
        return None
    scaling = dict(scaling)
    legacy_type = scaling.pop("type", None)
    rope_type = scaling.setdefault("rope_type", legacy_type or "default")
    is_plain = set(scaling) <= {"rope_type", "partial_rotary_factor"}
    if rope_type == "default" and is_plain and scaling.get("partial_rotary_factor", 1.0) == 1.0:
        return None
    return scaling


def normalize_token_ids(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """An ``eos_token_id`` (an int, a list or None) as a tuple without duplicates."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(token_id) for token_id in value))


def _sliding_window(hf_config: Any, architecture: str) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if architecture == "llama" or window is None:
        return None
    if architecture == "qwen2":
        # Qwen2Config sets sliding_window to None unless use_sliding_window; when set, only the
        # layers from max_window_layers on slide, which one window per model cannot express.
        layer_types = getattr(hf_config, "layer_types", None) or []
        if any(kind != "sliding_attention" for kind in layer_types):
            raise ValueError(
                f"qwen2 with sliding_window={window} on only some layers (layer_types="
                f"{layer_types}) is not supported"
            )
    return int(window)


def _eos_for_hf(eos_token_ids: tuple[int, ...]) -> int | list[int] | None:
    if not eos_token_ids:
        return None
    return eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)


def _rope_kwargs_for_hf(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    import transformers

    if hasattr(transformers.PretrainedConfig, "standardize_rope_params"):  # transformers >= 5
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None}
