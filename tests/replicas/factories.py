"""Stand-ins for what a model replica is handed (``replicas.protocol.ReplicaServices``) and for
its engine, so the replica's own logic runs without Redis, Ray or a model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from replicas.engine.config import EngineConfig
from replicas.engine.interface import (
    CachedPrefix,
    Chunk,
    FinishReason,
    GenerateRequest,
    LoadSnapshot,
    Timings,
    Usage,
)
from replicas.protocol import (
    CallSampling,
    CallStream,
    LogprobWire,
    ReplicaCall,
    ReplicaLoad,
    ReplicaServices,
)


class ScriptedEngine:
    """Each request gets ``max_tokens`` chunks of one token (its ids count from 1), the last
    with ``length``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_shut_down = False

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        total = request.sampling.max_tokens
        for i in range(1, total + 1):
            is_last = i == total
            yield Chunk(request.request_id, (i,), f" t{i}",
                        FinishReason.LENGTH if is_last else None,
                        usage=Usage(len(request.prompt_token_ids or ()), 0, total)
                        if is_last else None,
                        timings=Timings(1.0, 1.0, 1.0, 2.0) if is_last else None)

    async def abort(self, request_id: str) -> bool:
        return False

    def cached_prefix(self) -> CachedPrefix:
        return CachedPrefix()

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(0, 0, 10, 10, 4, num_steps=7, progress=9, compute="scripted")

    async def check_health(self) -> None:
        return None

    async def shutdown(self) -> None:
        self.is_shut_down = True


@dataclass(slots=True)
class Written:
    stream: CallStream
    text: str
    token_ids: tuple[int, ...]
    position: int
    finish_reason: str | None


@dataclass(slots=True)
class MemorySink:
    """A ``StreamSink`` that keeps what it is given; it halts the calls with ``halt`` (a
    ``Halt``) once it holds ``halt_after`` chunks."""

    written: list[Written] = field(default_factory=list)
    halt: str | None = None
    halt_after: int = 0
    is_closed: bool = False

    async def write(self, stream: CallStream, text: str, token_ids: Sequence[int],
                    position: int, logprobs: list[LogprobWire] | None, index: int,
                    finish_reason: str | None) -> str | None:
        self.written.append(Written(stream, text, tuple(token_ids), position, finish_reason))
        return self.halt if self.halt and len(self.written) >= self.halt_after else None

    async def close(self) -> None:
        self.is_closed = True


@dataclass(slots=True)
class MemoryPublisher:
    """A ``LoadPublisher`` that keeps the reports it took and who withdrew."""

    snapshot: Callable[[], ReplicaLoad]
    interval_s: float
    reports: list[ReplicaLoad] = field(default_factory=list)
    withdrawn: list[str] = field(default_factory=list)

    async def report(self) -> None:
        self.reports.append(self.snapshot())

    async def run(self) -> None:
        return None

    async def withdraw(self, replica_id: str) -> None:
        self.withdrawn.append(replica_id)


@dataclass(frozen=True, slots=True)
class NoTracing:
    tracer: None = None

    def shutdown(self) -> None:
        return None


@dataclass(slots=True)
class MemoryServices:
    """Hands out one sink and one publisher and keeps them for the test to read."""

    sink: MemorySink = field(default_factory=MemorySink)
    publishers: list[MemoryPublisher] = field(default_factory=list)

    def services(self) -> ReplicaServices:
        return ReplicaServices(stream_sink=lambda: self.sink, load_publisher=self._publisher,
                               tracing=lambda name: NoTracing(), node_name=lambda: "here")

    def _publisher(self, snapshot: Callable[[], ReplicaLoad], interval_s: float
                   ) -> MemoryPublisher:
        self.publishers.append(MemoryPublisher(snapshot, interval_s))
        return self.publishers[-1]


def a_call(request_id: str = "req-1", max_tokens: int = 3) -> ReplicaCall:
    return ReplicaCall(request_id, (1, 2, 3), CallSampling(max_tokens=max_tokens),
                       CallStream("tenant", request_id, "holder", 1, "writer"))
