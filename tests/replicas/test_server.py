"""The model replica runs on what it is handed (``replicas.protocol.ReplicaServices``): its
chunks go to the stream sink with their positions, its load report to the publisher, a halt
from the sink stops the call with that reason, and shutdown withdraws and closes. No Redis, no
router: the replica does not know them."""

from __future__ import annotations

import asyncio

import pytest

from replicas.engine.config import EngineConfig
from replicas.protocol import CallReport, Halt
from replicas.server import ModelReplica, ReplicaOptions
from tests.replicas.factories import MemoryServices, ScriptedEngine, a_call

# Ray Serve awaits the replica's async __del__; here the garbage collector calls it again, and
# drops the coroutine
pytestmark = pytest.mark.filterwarnings(
    "ignore:coroutine 'ModelReplica.__del__' was never awaited:RuntimeWarning")


async def _replica(memory: MemoryServices) -> ModelReplica:
    replica = object.__new__(ModelReplica)  # Ray Serve awaits the async __init__ itself
    options = ReplicaOptions(EngineConfig(), max_ongoing_requests=4)
    await replica.__init__(options, memory.services(), ScriptedEngine)  # type: ignore[misc]
    return replica


async def _reports(replica: ModelReplica, max_tokens: int) -> list[CallReport]:
    return [CallReport.decode(wire) async for wire in replica.generate(a_call(
        max_tokens=max_tokens))]


def test_a_call_s_chunks_go_to_the_sink_and_its_end_comes_back_over_ray() -> None:
    async def scenario() -> None:
        memory = MemoryServices()
        replica = await _replica(memory)
        reports = await _reports(replica, 3)
        assert [r.replica_id for r in reports] == [replica.replica_id] * 2
        assert (reports[-1].finish_reason, reports[-1].position) == ("length", 3)
        assert [(w.token_ids, w.position) for w in memory.sink.written] == [
            ((1,), 1), ((2,), 2), ((3,), 3)]
        assert memory.sink.written[-1].finish_reason == "length"
        assert memory.sink.written[0].stream == a_call().stream
        [publisher] = memory.publishers
        [load] = publisher.reports  # one at start; ``run`` reports the rest
        assert (load.replica_id, load.max_ongoing, load.node, load.num_steps, load.progress,
                load.model) == (replica.replica_id, 4, "here", 7, 9, "SmolLM2-135M-Instruct")
        await replica.__del__()
        assert publisher.withdrawn == [replica.replica_id]
        assert memory.sink.is_closed
    asyncio.run(scenario())


def test_a_halt_from_the_sink_stops_the_call_with_its_reason() -> None:
    async def scenario() -> None:
        memory = MemoryServices()
        memory.sink.halt, memory.sink.halt_after = Halt.LEASE_LOST, 2
        replica = await _replica(memory)
        reports = await _reports(replica, 5)
        assert reports[-1] == CallReport(halted=Halt.LEASE_LOST)
        assert len(memory.sink.written) == 2
        assert replica.load_report().ongoing == 0
        await replica.__del__()
    asyncio.run(scenario())
