"""fairserve's ``EngineConfig`` (plus the vLLM-only ``VLLMOptions``) -> the keyword arguments
of vLLM's ``AsyncEngineArgs``.

Mapped: the model path (a Hugging Face directory; vLLM 0.10 also reads GGUF files, 0.34 has no
GGUF loader), served name, dtype, ``max_model_len``, ``max_num_seqs``,
``max_num_batched_tokens``, ``enable_prefix_caching``, ``block_size`` and ``num_kv_blocks``
(vLLM's ``num_gpu_blocks_override``). Not mapped, and why:

- ``device``: vLLM picks its platform and GPUs itself (``CUDA_VISIBLE_DEVICES``, Ray's GPU
  assignment); ``cuda:1`` cannot be passed through.
- ``kv_cache_bytes`` becomes vLLM's ``kv_cache_memory_bytes`` when set (newer vLLM; 0.10 has
  none); null (the default) leaves the cache to ``gpu_memory_utilization``, as on the torch
  engine's GPU path.
- ``model_cache_dir``, ``num_threads``: the torch engine's; ``max_queue_wait_s`` is read by the
  adapter's own health check.

Statistics stay on (``disable_log_stats=False``): without them vLLM attaches no timestamps to
its outputs and reports no scheduler load.
"""

from __future__ import annotations

from typing import Any

from replicas.engine.config import EngineConfig
from replicas.engine.errors import InvalidRequestError
from replicas.engine.sampling_params import MAX_TOP_LOGPROBS


def engine_args_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Keyword arguments of ``vllm.engine.arg_utils.AsyncEngineArgs``; optional values left
    unset (None) are left out so vLLM applies its own defaults."""
    kwargs: dict[str, Any] = {
        "model": config.model,
        "served_model_name": config.served_model_name,
        "dtype": config.dtype.value,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "block_size": config.block_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.vllm.tensor_parallel_size,
        "enforce_eager": config.vllm.enforce_eager,
        "max_logprobs": MAX_TOP_LOGPROBS,
        "disable_log_stats": False,
    }
    optional = {
        "max_model_len": config.max_model_len,
        "num_gpu_blocks_override": config.num_kv_blocks,
        "kv_cache_memory_bytes": config.kv_cache_bytes,
    }
    kwargs.update({name: value for name, value in optional.items() if value is not None})
    if config.lora_adapters or config.vllm.enable_lora:
        kwargs.update(enable_lora=True, max_loras=config.max_loras,
                      max_lora_rank=config.vllm.max_lora_rank)
    return kwargs


def lora_args(config: EngineConfig, adapter: str | None, path: str | None,
              ids: dict[str, int]) -> tuple[str, int, str] | None:
    """``vllm.lora.request.LoRARequest``'s arguments for a request's adapter (name, a positive
    id stable per name, which ``ids`` keeps, and the path), None for the base model;
    ``InvalidRequestError`` naming ``model`` for one the engine cannot serve."""
    if adapter is None:
        return None
    if not (config.lora_adapters or config.vllm.enable_lora):
        raise InvalidRequestError(f"adapter {adapter!r}: this vllm engine serves no LoRA "
                                  "adapters (engine.lora_adapters, or vllm.enable_lora)", "model")
    where = path or config.lora_adapters.get(adapter)
    if where is None:
        raise InvalidRequestError(f"no adapter {adapter!r} on this replica", "model")
    return adapter, ids.setdefault(adapter, len(ids) + 1), where
