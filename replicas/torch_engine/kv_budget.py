"""How many bytes the paged KV cache gets: the setting, or on a GPU what is left of its memory.

NOTE: on a GPU the budget is measured after the weights are on it, as vLLM does:
``total x gpu_memory_utilization - memory in use (weights, the CUDA context, other processes)
- a reserve for one step's activations``. The reserve is an upper estimate from the step's
shapes (hidden states and MLP intermediates of ``max_num_batched_tokens`` tokens, the logits
of ``max_num_seqs`` rows in float32), not a profiled peak. A CPU has no such measure: its
default is a fixed 1 GiB.
"""

from __future__ import annotations

import torch

from replicas.engine.config import EngineConfig
from replicas.torch_engine.models.model_config import ModelConfig

DEFAULT_CPU_KV_BYTES = 1024 * 1024 * 1024
ACTIVATION_SLACK = 2  # the estimate counts each live tensor once; allocator fragmentation, twice


def activation_reserve_bytes(config: EngineConfig, model: ModelConfig, dtype_bytes: int) -> int:
    tokens = config.max_num_batched_tokens
    per_token = (4 * model.hidden_size + 3 * model.intermediate_size) * dtype_bytes
    logits = config.max_num_seqs * model.vocab_size * 4
    return ACTIVATION_SLACK * (tokens * per_token + logits)


def gpu_kv_budget(total_bytes: int, used_bytes: int, utilization: float, reserve_bytes: int) -> int:
    """The KV bytes of a GPU with ``used_bytes`` of ``total_bytes`` taken; raises when none
    are left, naming the numbers."""
    budget = int(total_bytes * utilization) - used_bytes - reserve_bytes
    if budget <= 0:
        gib = 1024**3
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {total_bytes / gib:.1f} GiB "
            f"- {used_bytes / gib:.1f} GiB in use - {reserve_bytes / gib:.2f} GiB for activations "
            f"= {budget / gib:.2f} GiB; raise engine.gpu_memory_utilization or lower "
            "max_num_batched_tokens / max_num_seqs")
    return budget


def kv_cache_bytes(config: EngineConfig, device: torch.device, model: ModelConfig,
                   dtype: torch.dtype) -> int:
    """The KV budget of an engine whose weights are already on ``device``."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_reserve_bytes(config, model, torch.empty((), dtype=dtype).element_size())
    return gpu_kv_budget(total, total - free, config.gpu_memory_utilization, reserve)
