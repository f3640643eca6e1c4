"""The engine a replica hosts, by ``engine.kind``: fairserve's torch engine or vLLM's."""

from __future__ import annotations

from replicas.engine.async_engine import TorchEngine
from replicas.engine.config import EngineConfig, EngineKind
from replicas.engine.interface import Engine


def make_engine(config: EngineConfig) -> Engine:
    if config.kind is EngineKind.VLLM:
        # imported here: vLLM itself is imported only when its engine starts (GPU machines)
        from replicas.engine.vllm.engine import VLLMEngine

        return VLLMEngine(config)
    return TorchEngine(config)
