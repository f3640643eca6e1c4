"""The batched prefill/decode engine: continuous batching over a paged KV cache.

``TorchEngine`` is what a replica runs; ``EngineCore`` is its synchronous step loop. See the
README section "The engine" for the knobs and the measured roofline.
"""

from replicas.engine.async_engine import TorchEngine
from replicas.engine.config import DType, EngineConfig, default_model_path
from replicas.engine.engine_core import EngineCore
from replicas.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
)
from replicas.engine.interface import (
    Chunk,
    Engine,
    FinishReason,
    GenerateRequest,
    LoadSnapshot,
    Timings,
    TokenLogprob,
    Usage,
)
from replicas.engine.sampling_params import SamplingParams

__all__ = [
    "Chunk",
    "DType",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineError",
    "FinishReason",
    "GenerateRequest",
    "InvalidRequestError",
    "LoadSnapshot",
    "ModelLoadError",
    "SamplingParams",
    "Timings",
    "TokenLogprob",
    "TorchEngine",
    "Usage",
    "default_model_path",
]
