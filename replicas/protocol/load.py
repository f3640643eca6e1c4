"""A replica's load report: how busy it is, as it publishes it for dispatchers, autoscaling
and ``fairserve top``. The replica builds it; the router's ``LoadReporter``
(``router/state/load_report.py``, injected into the replica) writes it to Redis, and the
router reads it back (``router/state/capacity.py``). JSON is its one codec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica_id: str
    max_ongoing: int  # slots: requests it takes at once (Ray Serve's max_ongoing_requests)
    ongoing: int
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    output_tokens_per_s: float
    reported_ms: int
    num_steps: int = 0  # the engine's steps so far
    # the engine's work so far: its steps, and the model layers run within them where it counts
    # those; a hung engine stops counting, a long step (a long prompt's chunk) does not
    progress: int = 0
    compute: str = ""  # the engine, device and dtype ("torch cpu bfloat16")
    node: str = ""  # where it runs: host (pod) / Ray node id
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds loaded (at most max_loras)
    model: str = ""  # the base model it serves (engine.served_model_name)

    @property
    def is_busy(self) -> bool:
        return bool(self.ongoing or self.num_running or self.num_waiting)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ReplicaLoad:
        fields = json.loads(raw)
        fields["adapters"] = tuple(fields.get("adapters", ()))
        # a replica of a release before progress (a rolling upgrade): its steps are its progress
        fields.setdefault("progress", fields.get("num_steps", 0))
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.__slots__})
