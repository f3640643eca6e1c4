"""The engine a replica hosts, by ``engine.kind``: fairserve's torch engine or vLLM's.

Each implementation is imported inside ``make_engine``, so importing the contract loads neither
torch nor vLLM; vLLM itself is imported only when its engine starts (GPU machines)."""

from __future__ import annotations

from replicas.engine.config import EngineConfig, EngineKind
from replicas.engine.interface import Engine


def make_engine(config: EngineConfig) -> Engine:
    if config.kind is EngineKind.VLLM:
        from replicas.vllm_engine.engine import VLLMEngine

        return VLLMEngine(config)
    from replicas.torch_engine.async_engine import TorchEngine

    return TorchEngine(config)
