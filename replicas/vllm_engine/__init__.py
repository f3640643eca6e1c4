"""The vLLM engine adapter (``engine.kind: vllm``): vLLM's ``AsyncLLM`` behind the ``Engine``
contract. Importing this package does not import vLLM; ``VLLMEngine.start`` does.

``sampling``, ``outputs``, ``resume``, ``admission``, ``error_map``, ``engine_args`` and ``load``
translate between fairserve's records and vLLM's; ``engine`` drives vLLM with them.
"""

from replicas.vllm_engine.engine import VLLMEngine, load_tokenizer
from replicas.vllm_engine.engine_args import engine_args_kwargs

__all__ = ["VLLMEngine", "engine_args_kwargs", "load_tokenizer"]
