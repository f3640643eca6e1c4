"""The relay (router/dispatch/relay.py) on a real Redis, without Ray: the replica call's stream
is a scripted double (``ScriptedReplicas``) that does what a replica does: it appends its chunks
to the request's response stream as the writer the relay named (``ResponseStreams.append``,
fenced by lease, writer and position, as ``router/dispatch/stream_writer.py`` does) and yields the
typed reports of ``replicas.protocol`` (``CallReport``). Everything else (leases, the stream,
completion and settlement, requeueing) is the real Redis scripts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from replicas.protocol import CallReport, ChunkUsage, Halt, ReplicaCall, ReplicaLoad
from router.dispatch import response_events
from router.dispatch.relay import Relay, RelaySettings, Running, lose_lease
from router.dispatch.response_events import ChunkData, EndData
from router.dispatch.streams import Event
from router.errors import LeaseLostError, ReplicaFailedError, ReplicaUnavailableError
from router.messages import AdmitRequest, Grant, Lease, RequestState, StreamEvent
from router.state import keys
from router.state.tenants import Tenant
from router.telemetry.tracing import OFF
from tests.router.factories import Harness, add_tenants, harness, run

HOLDER = "router-a"
PROMPT = [11, 12, 13]
FAST = RelaySettings(max_migrations=3, stall_timeout_s=0.3, stall_check_s=0.05)


@dataclass(frozen=True)
class Chunk:
    """A step of a scripted call: append these tokens of ``choice`` after ``start`` tokens."""

    token_ids: tuple[int, ...]
    start: int
    choice: int = 0


class Hang:
    """A step of a scripted call: the replica froze (the stream neither yields nor ends)."""


@dataclass(frozen=True)
class Pause:
    """A step of a scripted call: nothing on the stream for ``seconds`` (a long engine step)."""

    seconds: float


@dataclass(frozen=True)
class Do:
    """A step of a scripted call: something else happens meanwhile (``action()``)."""

    action: Any


Step = Chunk | CallReport | BaseException | Hang | Pause | Do


@dataclass
class ScriptedStream:
    """One replica call's stream (what a Ray handle's streaming response is to the relay)."""

    replicas: ScriptedReplicas
    call: ReplicaCall
    steps: list[Step]
    is_cancelled: bool = False

    def cancel(self) -> None:
        self.is_cancelled = True

    async def __aiter__(self) -> AsyncIterator[CallReport]:
        for step in self.steps:
            if self.is_cancelled:  # as a Ray stream: nothing more after a cancel
                return
            if isinstance(step, Hang):
                await asyncio.Event().wait()
            elif isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, Do):
                step.action()
            elif isinstance(step, Chunk):
                await self.replicas.append(self.call, step)
            elif isinstance(step, BaseException):
                raise step
            else:
                yield step


@dataclass
class ScriptedReplicas:
    """A ``ReplicaPool`` whose n-th call runs the n-th script."""

    h: Harness
    scripts: list[list[Step]]
    calls: list[ReplicaCall] = field(default_factory=list)
    streams: list[ScriptedStream] = field(default_factory=list)
    refused: list[Exception] = field(default_factory=list)  # appends the stream refused

    def generate(self, call: ReplicaCall) -> ScriptedStream:
        stream = ScriptedStream(self, call, self.scripts[len(self.calls)])
        self.calls.append(call)
        self.streams.append(stream)
        return stream

    async def append(self, call: ReplicaCall, chunk: Chunk) -> None:
        position = chunk.start + len(chunk.token_ids)
        text = "".join(f"<{t}>" for t in chunk.token_ids)
        data = response_events.chunk_data(text, list(chunk.token_ids), position, None,
                                          chunk.choice)
        s = call.stream
        lease = Lease(s.tenant_id, s.request_id, s.holder, s.attempt)
        try:
            await self.h.streams.append(lease, [Event(response_events.CHUNK, data, chunk.choice,
                                                      position, chunk.start)], s.writer)
        except (LeaseLostError, ReplicaFailedError) as exc:
            self.refused.append(exc)


def finish(position: int, reason: str = "stop", cached: int = 0, index: int = 0) -> CallReport:
    return CallReport(index=index, finish_reason=reason, position=position,
                      usage=ChunkUsage(len(PROMPT), position, cached))


async def granted(h: Harness, request_id: str = "r1", n: int = 1) -> Grant:
    await add_tenants(h, Tenant(id="t"))
    body = json.dumps({"prompt_token_ids": PROMPT, "sampling": {"max_tokens": 8, "n": n}})
    await h.queues.admit(AdmitRequest("t", request_id, len(PROMPT), 8, body, num_choices=n))
    (grant,) = (await h.queues.grant(HOLDER, 1)).grants
    return grant


async def stream_of(h: Harness, grant: Grant) -> list[ChunkData | EndData]:
    raw: Any = await h.client.xrange(keys.stream(grant.tenant_id, grant.request_id))
    return [response_events.parse(StreamEvent(i.decode(), f[b"type"].decode(),
                                               f[b"data"].decode())) for i, f in raw]


def token_ids(events: list[ChunkData | EndData], choice: int = 0) -> list[int]:
    return [t for e in events if isinstance(e, ChunkData) and e.index == choice
            for t in e.token_ids or []]


async def relay_run(h: Harness, grant: Grant, replicas: ScriptedReplicas,
                    settings: RelaySettings = FAST) -> tuple[Running, list[tuple[str, str]]]:
    migrations: list[tuple[str, str]] = []
    relay = Relay(h.queues, h.streams, replicas, OFF, settings,
                  on_migration=lambda tenant, reason: migrations.append((tenant, reason)))
    running = Running(grant, time.time_ns(), time.time_ns())
    await asyncio.wait_for(relay.run(running), 20)
    return running, migrations


def test_the_replicas_chunks_are_in_the_stream_in_order_then_the_end_with_its_usage(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [[CallReport(replica_id="rep-1"), Chunk((1, 2), 0),
                                             Chunk((3,), 2), Chunk((4,), 3),
                                             finish(4, cached=2)]])
            running, migrations = await relay_run(h, grant, replicas)

            (call,) = replicas.calls
            assert call.prompt_token_ids == tuple(PROMPT) and call.resume == ()
            assert call.stream.writer == "1.0" and call.sampling.max_tokens == 8
            events = await stream_of(h, grant)
            assert token_ids(events) == [1, 2, 3, 4]
            assert [e.position for e in events[:-1]] == [2, 3, 4]  # type: ignore[union-attr]
            end = events[-1]
            assert isinstance(end, EndData)
            assert (end.finish_reason, end.prompt_tokens, end.completion_tokens,
                    end.cached_tokens) == ("stop", 3, 4, 2)
            record = await h.queues.get("t", "r1")
            assert record.state is RequestState.COMPLETED
            assert (record.prompt_tokens_used, record.output_tokens_used) == (3, 4)
            assert running.replica_id == "rep-1" and migrations == []

    run(scenario())


def test_a_replica_lost_mid_stream_is_migrated_and_the_client_gets_each_token_once(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1, 2), 0),
                 ReplicaUnavailableError("actor died")],
                # the next replica makes token 2 again (dropped: its position is in the stream)
                [CallReport(replica_id="rep-2"), Chunk((2,), 1), Chunk((3,), 2),
                 finish(3, "length")]])
            running, migrations = await relay_run(h, grant, replicas)

            first, second = replicas.calls
            assert second.stream.writer != first.stream.writer
            (resume,) = second.resume
            assert (resume.index, resume.token_ids, resume.num_text_chars_sent,
                    resume.is_finished) == (0, (1, 2), len("<1><2>"), False)
            events = await stream_of(h, grant)
            assert token_ids(events) == [1, 2, 3]
            end = events[-1]
            assert isinstance(end, EndData)
            assert (end.finish_reason, end.completion_tokens) == ("length", 3)
            assert running.migrations == 1 and migrations == [("t", "replica_unavailable")]
            assert (await h.queues.get("t", "r1")).output_tokens_used == 3

    run(scenario())


def test_the_call_given_up_on_can_no_longer_write_to_the_stream(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1,), 0), ReplicaUnavailableError("x")],
                [CallReport(replica_id="rep-2"), Chunk((2,), 1), finish(2)]])
            await relay_run(h, grant, replicas)
            stale = ScriptedStream(replicas, replicas.calls[0], [])
            await replicas.append(stale.call, Chunk((9,), 1))  # it thawed: refused
            assert len(replicas.refused) == 1
            assert isinstance(replicas.refused[0], LeaseLostError)
            assert token_ids(await stream_of(h, grant)) == [1, 2]

    run(scenario())


def test_an_end_whose_chunks_the_stream_lost_is_a_gap_and_the_tokens_are_made_again(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            # the replica says 3 tokens went out, but the stream holds 2 (a failover lost one)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1, 2), 0), finish(3)],
                [CallReport(replica_id="rep-2"), Chunk((3,), 2), finish(3)]])
            running, migrations = await relay_run(h, grant, replicas)

            assert replicas.calls[1].resume[0].token_ids == (1, 2)
            assert [reason for _, reason in migrations] == ["stream_gap"]
            events = await stream_of(h, grant)
            assert token_ids(events) == [1, 2, 3]
            record = await h.queues.get("t", "r1")
            assert (record.state, record.output_tokens_used) == (RequestState.COMPLETED, 3)

    run(scenario())


def test_a_stream_gap_halt_moves_the_request(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1,), 0),
                 CallReport(halted=Halt.STREAM_GAP)],
                [CallReport(replica_id="rep-2"), Chunk((2,), 1), finish(2)]])
            running, _ = await relay_run(h, grant, replicas)
            assert running.migrations == 1
            assert token_ids(await stream_of(h, grant)) == [1, 2]
            assert replicas.calls[1].avoid == ()  # a lost stream is Redis's doing, not rep-1's

    run(scenario())


def test_a_replica_that_stops_reporting_is_stalled_cancelled_and_the_request_moves(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            # rep-1 has no heartbeat in Redis: it stopped reporting
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1,), 0), Hang()],
                [CallReport(replica_id="rep-2"), Chunk((2,), 1), finish(2)]])
            started = time.monotonic()
            running, migrations = await relay_run(h, grant, replicas)

            assert replicas.streams[0].is_cancelled and not replicas.streams[1].is_cancelled
            assert time.monotonic() - started >= FAST.stall_timeout_s
            assert [reason for _, reason in migrations] == ["stalled"]
            assert token_ids(await stream_of(h, grant)) == [1, 2]
            # the second call asks the request router to pass over the stalled replica
            assert [c.avoid for c in replicas.calls] == [(), ("rep-1",)]
            assert (await h.queues.get("t", "r1")).state is RequestState.COMPLETED

    run(scenario())


@contextlib.asynccontextmanager
async def heartbeat(h: Harness, replica_id: str, is_working: bool) -> AsyncIterator[None]:
    """While in the block: a busy replica's load reports, every 20 ms, in one engine step that
    never ends: its step count stands still; its progress (the layers it runs) counts on while
    ``is_working`` (a long prompt's chunk), and stands still too when not (a hung engine)."""
    async def beat() -> None:
        progress = 0
        while True:
            progress += is_working
            load = ReplicaLoad(replica_id, 4, 1, 1, 0, 10, 10, 0.0, int(time.time() * 1000),
                               num_steps=5, progress=progress)
            await h.client.set(keys.replica(replica_id), load.to_json(), ex=5)
            await asyncio.sleep(0.02)

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()


def test_a_step_longer_than_the_stall_timeout_that_runs_its_layers_is_left_alone(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [[CallReport(replica_id="rep-1"),
                                             Pause(5 * FAST.stall_timeout_s), Chunk((1,), 0),
                                             finish(1)]])
            async with heartbeat(h, "rep-1", is_working=True):
                running, migrations = await relay_run(h, grant, replicas)

            assert migrations == [] and len(replicas.calls) == 1
            assert not replicas.streams[0].is_cancelled
            assert token_ids(await stream_of(h, grant)) == [1]

    run(scenario())


def test_a_busy_replica_whose_engine_makes_no_progress_is_stalled_and_the_request_moves(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1,), 0), Hang()],
                [CallReport(replica_id="rep-2"), Chunk((2,), 1), finish(2)]])
            started = time.monotonic()
            async with heartbeat(h, "rep-1", is_working=False):
                running, migrations = await relay_run(h, grant, replicas)

            assert replicas.streams[0].is_cancelled
            # the first look records the progress; no change for a stall timeout after it
            assert time.monotonic() - started >= 2 * FAST.stall_timeout_s
            assert [reason for _, reason in migrations] == ["stalled"]
            assert token_ids(await stream_of(h, grant)) == [1, 2]

    run(scenario())


def test_a_cancelled_call_ends_the_request_cancelled_with_the_tokens_it_used(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1, 2), 0),
                 CallReport(halted=Halt.CANCELLED)]])
            running, migrations = await relay_run(h, grant, replicas)

            assert running.is_cancel_requested and migrations == []
            end = (await stream_of(h, grant))[-1]
            assert isinstance(end, EndData)
            assert (end.finish_reason, end.completion_tokens) == ("abort", 2)
            record = await h.queues.get("t", "r1")
            assert (record.state, record.output_tokens_used) == (RequestState.CANCELLED, 2)

    run(scenario())


def test_a_lease_lost_at_renewal_drops_the_attempt_and_never_ends_the_request(redis_url) -> None:
    """A renewal's "lease lost" may come from a primary a failover is about to demote while the
    lease still holds on the new one: the client must not get an end it did not ask for
    (before: it got ``abort`` and the request was settled as cancelled)."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            running = Running(grant, time.time_ns(), time.time_ns())
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1, 2), 0), Do(lambda: lose_lease(running)),
                 Chunk((3,), 2), finish(3)]])
            relay = Relay(h.queues, h.streams, replicas, OFF, FAST)
            with pytest.raises(LeaseLostError, match="lost at its renewal"):
                await asyncio.wait_for(relay.run(running), 20)

            assert replicas.streams[0].is_cancelled and not running.is_cancel_requested
            events = await stream_of(h, grant)
            assert token_ids(events) == [1, 2]
            assert not any(isinstance(e, EndData) for e in events)
            record = await h.queues.get("t", "r1")
            assert record.state is RequestState.LEASED  # served again when the lease runs out

    run(scenario())


def test_a_failure_in_the_replicas_code_fails_the_request_with_an_error_event(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), Chunk((1,), 0),
                 ReplicaFailedError("ValueError: bad logits")]])
            running, migrations = await relay_run(h, grant, replicas)

            assert migrations == [] and len(replicas.calls) == 1
            end = (await stream_of(h, grant))[-1]
            assert isinstance(end, EndData) and end.error is not None
            assert "bad logits" in end.error["message"] and end.completion_tokens == 1

    run(scenario())


def test_with_no_migrations_left_and_nothing_sent_the_request_goes_back_to_its_queue(
        redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [[ReplicaUnavailableError("no replica")]])
            settings = RelaySettings(max_migrations=0, stall_timeout_s=0.3, stall_check_s=0.05)
            await relay_run(h, grant, replicas, settings)

            assert (await h.queues.get("t", "r1")).state is RequestState.QUEUED
            assert await stream_of(h, grant) == []  # no end: it runs again
            (again,) = (await h.queues.grant(HOLDER, 1)).grants
            assert again.lease.attempt == 2

    run(scenario())


def test_a_lease_lost_report_stops_the_relay(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h)
            replicas = ScriptedReplicas(h, [
                [CallReport(replica_id="rep-1"), CallReport(halted=Halt.LEASE_LOST)]])
            with pytest.raises(LeaseLostError):
                await relay_run(h, grant, replicas)
            assert len(replicas.calls) == 1

    run(scenario())


def test_n_choices_end_once_with_each_choices_finish_reason(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grant = await granted(h, n=2)
            replicas = ScriptedReplicas(h, [[
                CallReport(replica_id="rep-1"), Chunk((1,), 0, 0), Chunk((7, 8), 0, 1),
                finish(2, "length", index=1), Chunk((2,), 1, 0), finish(2, index=0)]])
            await relay_run(h, grant, replicas)

            events = await stream_of(h, grant)
            assert (token_ids(events, 0), token_ids(events, 1)) == ([1, 2], [7, 8])
            ends = [e for e in events if isinstance(e, EndData)]
            assert len(ends) == 1
            assert (ends[0].finish_reasons, ends[0].completion_tokens) == (["stop", "length"], 4)

    run(scenario())
