"""The engine contract: what a replica asks of an engine and what it gets back, torch-free.

``Engine`` (``interface.py``) is the protocol every engine implements; ``EngineConfig``
(``config.py``) names which one a replica runs and ``make_engine`` (``factory.py``) builds it,
importing the implementation only then. The implementations live beside this package:
``replicas.torch_engine`` (fairserve's own continuous-batching engine, torch) and
``replicas.vllm_engine`` (vLLM's ``AsyncLLM`` behind the same protocol). Importing this package
loads neither torch nor vLLM, so the CLI, the settings and the tests of the contract can use it.
"""

from replicas.engine.config import DType, EngineConfig, EngineKind, default_model_path
from replicas.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
)
from replicas.engine.factory import make_engine
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
    "EngineDeadError",
    "EngineError",
    "EngineKind",
    "FinishReason",
    "GenerateRequest",
    "InvalidRequestError",
    "LoadSnapshot",
    "ModelLoadError",
    "SamplingParams",
    "Timings",
    "TokenLogprob",
    "Usage",
    "default_model_path",
    "make_engine",
]
