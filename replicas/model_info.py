"""What the router needs to know of the model, read without loading its weights."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from replicas.engine.config import DType, EngineConfig
from replicas.protocol import ModelInfo
from replicas.torch_engine.device_choice import TORCH_DTYPES, resolve_device
from replicas.torch_engine.kv_budget import DEFAULT_CPU_KV_BYTES
from replicas.torch_engine.loader import load_model_source
from replicas.torch_engine.model_runner import CacheShape
from replicas.torch_engine.models.model_config import ModelConfig


def describe_model(config: EngineConfig) -> ModelInfo:
    """Limits and tokenizer of the model an engine with ``config`` serves (the same numbers
    ``EngineCore`` derives: context length, KV cache capacity)."""
    source = load_model_source(config.model, cache_dir=config.model_cache_dir)
    model_max = source.config.max_position_embeddings
    max_model_len = min(config.max_model_len or model_max, model_max)
    capacity_tokens = _kv_capacity_tokens(config, source.config, max_model_len)
    with tempfile.TemporaryDirectory(prefix="fairserve-tokenizer-") as directory:
        source.tokenizer.hf_tokenizer.save_pretrained(directory)
        files = {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}
    return ModelInfo(
        served_model_name=config.served_model_name,
        max_model_len=max_model_len,
        kv_capacity_tokens=capacity_tokens,
        tokenizer_files=files,
        created_s=int(time.time()),
        adapters=tuple(sorted(config.lora_adapters)),
        chat_template=Path(config.chat_template).read_text() if config.chat_template else None,
        tool_call_parser=config.tool_call_parser,
    )


def _kv_capacity_tokens(config: EngineConfig, model: ModelConfig, max_model_len: int) -> int:
    """Tokens one replica's KV cache holds, as the replicas will derive it (they may run on
    other hosts: ``device: auto`` is taken as it resolves here, so a GPU deployment whose
    head has no GPU names ``cuda``). ``dtype: auto`` counts float32, the widest a replica
    picks, so the number is a floor. A GPU replica with a budget from its free memory refuses to start unless its
    cache holds one whole context (engine_core.py): that is what the router may count on."""
    gpu = resolve_device(config.device).type == "cuda"  # auto: as on this host
    if config.num_kv_blocks is None and config.kv_cache_bytes is None and gpu:
        return max_model_len
    dtype = DType.FLOAT32 if config.dtype is DType.AUTO else config.dtype
    per_block = CacheShape.bytes_per_block(model, config.block_size, TORCH_DTYPES[dtype.value])
    num_blocks = config.num_kv_blocks or (config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES) // per_block
    return num_blocks * config.block_size
