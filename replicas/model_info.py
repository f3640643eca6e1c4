"""What the router needs to know of the model, read without loading its weights."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from replicas.engine.config import EngineConfig
from replicas.engine.engine_core import TORCH_DTYPES
from replicas.engine.loader import load_model_source
from replicas.engine.model_runner import CacheShape
from router.api.prompt_tokenizer import ModelInfo


def describe_model(config: EngineConfig) -> ModelInfo:
    """Limits and tokenizer of the model an engine with ``config`` serves (the same numbers
    ``EngineCore`` derives: context length, KV cache capacity)."""
    source = load_model_source(config.model, cache_dir=config.model_cache_dir)
    model_max = source.config.max_position_embeddings
    max_model_len = min(config.max_model_len or model_max, model_max)
    per_block = CacheShape.bytes_per_block(source.config, config.block_size,
                                           TORCH_DTYPES[config.dtype.value])
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes // per_block
    with tempfile.TemporaryDirectory(prefix="fairserve-tokenizer-") as directory:
        source.tokenizer.hf_tokenizer.save_pretrained(directory)
        files = {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}
    return ModelInfo(
        served_model_name=config.served_model_name,
        max_model_len=max_model_len,
        kv_capacity_tokens=num_blocks * config.block_size,
        tokenizer_files=files,
        created_s=int(time.time()),
    )
