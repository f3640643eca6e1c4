"""fairserve's torch engine: continuous batching over a paged KV cache (``engine.kind: torch``).

``TorchEngine`` (``async_engine.py``) is what a replica runs, behind the ``replicas.engine``
contract; ``EngineCore`` (``engine_core.py``) is its synchronous step loop: the ``Scheduler``
(``scheduler.py``, its policies in ``policies.py``) picks each step's sequences, the
``BlockManager`` holds their KV blocks, the ``ModelRunner`` runs ``models/`` on the weights
``loader/`` reads, and the ``Sampler`` picks the tokens. Importing this package loads torch.
"""

from replicas.torch_engine.async_engine import TorchEngine
from replicas.torch_engine.engine_core import EngineCore

__all__ = ["EngineCore", "TorchEngine"]
