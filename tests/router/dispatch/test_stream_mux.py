"""The stream multiplexer: hundreds of waiting readers on a small pool, new readers served at
once (no block timeout), several readers of one stream at their own positions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from router.dispatch import response_events
from router.dispatch.stream_mux import MAX_BUFFERED, READ_BLOCK_MS, StreamMux
from router.dispatch.streams import AppendBatcher, Event, ReadPoint
from router.errors import LeaseLostError
from router.messages import Grant, Lease, LeaseStatus
from router.state import keys
from router.state.redis_client import connect
from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, make_request, run

NUM_WAITERS = 300
POOL = 8


@contextlib.asynccontextmanager
async def running_mux(redis_url: str, protocol: int = 3) -> AsyncIterator[StreamMux]:
    """A started multiplexer on its own small pool (RESP3, redis-py's default, or RESP2),
    stopped after."""
    client = connect(redis_url, max_connections=POOL, protocol=protocol)
    mux = StreamMux(client)
    mux.start()
    try:
        yield mux
    finally:
        await mux.stop()
        await client.aclose()


async def _grants(h, n: int) -> list[Grant]:
    await add_tenants(h, Tenant(id="acme", max_queued=10_000))
    await h.queues.admit_many([make_request("acme", f"r{i}") for i in range(n)])
    grants: list[Grant] = []
    while len(grants) < n:
        grants += (await h.queues.grant("d", n, max_grants=500)).grants
    return grants


def test_hundreds_of_readers_share_one_blocking_connection(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grants = await _grants(h, NUM_WAITERS)
            async with running_mux(redis_url) as mux:
                async def reader(rid: str) -> list[str]:
                    return [e.data async for e in mux.read("acme", rid)]

                readers = [asyncio.create_task(reader(g.request_id)) for g in grants]
                await asyncio.sleep(0.2)
                for g in grants:
                    await h.streams.append(g.lease, [Event("chunk", f"hello {g.request_id}")])
                await h.queues.complete_many([(g.lease, 10, 1, "stop") for g in grants])
                results = await asyncio.wait_for(asyncio.gather(*readers), 30)
                assert results == [[f"hello {g.request_id}", "{}"] for g in grants]

    run(scenario())


def test_a_new_reader_does_not_wait_for_the_blocked_read(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            first, second = await _grants(h, 2)
            async with running_mux(redis_url) as mux:
                idle_reader = mux.read("acme", first.request_id)
                idle = asyncio.create_task(anext(idle_reader))
                await asyncio.sleep(0.3)  # the mux is now blocked on the first stream only
                await h.streams.append(second.lease, [Event("chunk", "now")])
                started = time.monotonic()
                reader = mux.read("acme", second.request_id)
                event = await anext(reader)
                waited_ms = (time.monotonic() - started) * 1000
                assert event.data == "now"
                assert waited_ms < READ_BLOCK_MS / 2, waited_ms
                idle.cancel()
                await reader.aclose()

    run(scenario())


@pytest.mark.parametrize("protocol", [2, 3])
def test_two_readers_of_one_stream_each_get_every_event_once(redis_url, protocol) -> None:
    """Under either protocol (the mux reads XREAD's reply as Redis sends it)."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            (grant,) = await _grants(h, 1)
            async with running_mux(redis_url, protocol) as mux:
                await h.streams.append(grant.lease, [Event("chunk", "a"), Event("chunk", "b")])
                early = mux.read("acme", grant.request_id)
                seen_early = [(await anext(early)).data, (await anext(early)).data]
                late = asyncio.create_task(_collect(mux, grant.request_id))
                await h.streams.append(grant.lease, [Event("chunk", "c")])
                await h.queues.complete(grant.lease, 10, 3, "stop")
                seen_early += [e.data async for e in early]
                assert seen_early == ["a", "b", "c", "{}"]
                assert await asyncio.wait_for(late, 10) == ["a", "b", "c", "{}"]

    run(scenario())


async def _collect(mux: StreamMux, rid: str) -> list[str]:
    return [e.data async for e in mux.read("acme", rid)]


def test_concurrent_appends_share_a_script_call_and_a_stale_one_fails_alone(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            grants = await _grants(h, 20)
            batcher = AppendBatcher(h.streams)
            stale = Lease("acme", grants[0].request_id, "d", grants[0].lease.attempt + 1)
            before = (await h.client.info("commandstats"))["cmdstat_evalsha"]["calls"]
            results = await asyncio.gather(
                batcher.append(stale, [Event("chunk", "dup")]),
                *(batcher.append(g.lease, [Event("chunk", g.request_id)]) for g in grants),
                return_exceptions=True)
            calls = (await h.client.info("commandstats"))["cmdstat_evalsha"]["calls"] - before
            assert isinstance(results[0], LeaseLostError)
            assert all(isinstance(r, LeaseStatus) for r in results[1:])
            assert calls == 1
            for g in grants:
                events = await h.client.xrange(keys.stream("acme", g.request_id))
                assert [e[1][b"data"].decode() for e in events] == [g.request_id]

    run(scenario())


def test_a_reader_behind_takes_what_piled_up_in_one_batch_up_to_the_end(redis_url) -> None:
    """Events that arrived while the reader was busy come as one batch (one write to its
    client); the batch stops at the terminal event, and every event comes once, in order."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            (grant,) = await _grants(h, 1)
            async with running_mux(redis_url) as mux:
                batches = mux.read_batches("acme", grant.request_id)
                await h.streams.append(grant.lease, [Event("chunk", "first")])
                first = await asyncio.wait_for(anext(batches), 10)
                assert [e.data for e in first] == ["first"]
                for i in range(5):  # the reader is not reading meanwhile
                    await h.streams.append(grant.lease, [Event("chunk", f"c{i}")])
                await h.queues.complete_many([(grant.lease, 10, 6, "stop")])
                await asyncio.sleep(0.3)  # the mux has delivered them all by now
                rest = [batch async for batch in batches]
                assert [[e.data for e in batch] for batch in rest] == [
                    ["c0", "c1", "c2", "c3", "c4", "{}"]]
                assert rest[0][-1].is_terminal

    run(scenario())


def test_an_idle_stream_ends_its_reader_with_a_stream_idle_error(redis_url) -> None:
    """A request that sends nothing for the idle timeout ends its reader with OpenAI's 504
    ``stream_idle_timeout`` (not "the queue store is unavailable", which a TimeoutError, an
    OSError, used to become); events before it are delivered; the ticks of one ticker, not a
    timer per wait, notice it."""
    import pytest

    from router.errors import StreamIdleError

    async def scenario() -> None:
        async with harness(redis_url) as h, running_mux(redis_url) as mux:
            (grant,) = await _grants(h, 1)
            await h.streams.append(grant.lease, [Event("chunk", "first")])
            seen: list[str] = []
            started = time.monotonic()
            with pytest.raises(StreamIdleError) as caught:
                async for batch in mux.read_batches("acme", grant.request_id,
                                                    idle_timeout_s=1.5):
                    seen += [event.data for event in batch]
            assert seen == ["first"]
            assert 1.5 <= time.monotonic() - started < 5
            assert (caught.value.status, caught.value.code) == (504, "stream_idle_timeout")
            assert not isinstance(caught.value, OSError)

    run(scenario())


def test_a_slow_reader_holds_a_bounded_buffer_and_still_gets_every_event(redis_url) -> None:
    """A client that reads slower than its stream is written: its waiter holds at most
    MAX_BUFFERED events (the router's memory per reader is bounded), the shared read goes on for
    the others, and the slow one gets every event, in order, from the stream itself."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            slow, quick = await _grants(h, 2)
            async with running_mux(redis_url) as mux:
                reader = mux.read_batches("acme", slow.request_id)
                await h.streams.append(slow.lease, [Event("chunk", "0")])
                got = [e.data for e in await asyncio.wait_for(anext(reader), 10)]
                for start in range(1, 1001, 100):  # while the slow client reads nothing
                    await h.streams.append(slow.lease, [Event("chunk", str(i))
                                                        for i in range(start, start + 100)])
                    await asyncio.sleep(0.02)
                (waiter,) = mux._waiters[keys.stream("acme", slow.request_id)]
                assert waiter.queue.qsize() <= MAX_BUFFERED and waiter.lagging
                await h.streams.append(quick.lease, [Event("chunk", "quick")])
                quick_reader = mux.read("acme", quick.request_id)
                assert (await asyncio.wait_for(anext(quick_reader), 10)).data == "quick"
                await quick_reader.aclose()
                await h.queues.complete_many([(slow.lease, 10, 1001, "stop")])
                async for batch in reader:
                    got += [e.data for e in batch]
                assert got == [str(i) for i in range(1001)] + ["{}"]

    run(scenario())


def test_a_reader_whose_last_event_was_lost_reads_again_and_skips_what_it_has(
        redis_url) -> None:
    """A Redis failover to a replica that had not received a stream's last events: the
    chunks are made again, and the new primary's clock may give them ids below the lost one.
    After it reconnects the mux reads such a stream from the start, and the reader's
    ``ReadPoint`` gives each token once."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            (g,) = await _grants(h, 1)
            stream_key = keys.stream("acme", g.request_id)

            def chunk(text: str, position: int) -> Event:
                return Event("chunk", response_events.chunk_data(text, [position], position,
                                                                 None), 0, position,
                             position - 1)

            await h.streams.append(g.lease, [chunk("a", 1), chunk("b", 2)])
            kept = await h.client.xrange(stream_key)
            # the old primary's clock ran ahead: the third chunk's id is far in the future
            future = f"{int(time.time() * 1000) + 3_600_000}-0"
            await h.client.xadd(stream_key, {"type": "chunk", "data": response_events.chunk_data(
                "c", [3], 3, None)}, id=future)
            await h.client.hset(keys.request("acme", g.request_id),
                                mapping={"pos:0": 3, "streamed": 3})
            async with running_mux(redis_url) as mux:
                point = ReadPoint()
                reader = mux.read("acme", g.request_id)
                got = []
                while len(got) < 3:
                    item = response_events.parse(await anext(reader))
                    assert isinstance(item, response_events.ChunkData)
                    if point.take(item):
                        got.append(item.text)
                assert point.event_id(future) == f"{future};3"
                # the failover: the new primary has the first two chunks only
                await h.client.delete(stream_key)
                for raw_id, fields in kept:
                    await h.client.xadd(stream_key, fields, id=raw_id)
                await h.client.hset(keys.request("acme", g.request_id),
                                    mapping={"pos:0": 2, "streamed": 2})
                assert mux._reader_id is not None
                await h.client.client_kill_filter(_id=mux._reader_id)
                await h.streams.append(g.lease, [chunk("c", 3), chunk("d", 4)])
                await h.queues.complete(g.lease, 10, 4, "stop", must_hold=4)

                async def rest() -> None:
                    async for event in reader:
                        item = response_events.parse(event)
                        if isinstance(item, response_events.ChunkData) and point.take(item):
                            got.append(item.text)

                await asyncio.wait_for(rest(), 20)  # without the recheck: waits for ever
                assert got == ["a", "b", "c", "d"]

    run(scenario())


def test_a_read_point_round_trips_through_the_id_a_client_is_given() -> None:
    point = ReadPoint()
    assert point.event_id("5-0") == "5-0"  # nothing taken: the stream id alone
    for index, position in ((0, 2), (2, 1), (0, 3)):
        assert point.take(response_events.ChunkData("x", 1, index=index, position=position))
    assert not point.take(response_events.ChunkData("x", 1, index=0, position=3))
    assert point.take(response_events.ChunkData("", 0))  # no token: never skipped
    assert point.event_id("7-1") == "7-1;3,0,1"
    again = ReadPoint.parse("7-1;3,0,1")
    assert (again.after, again.positions) == ("7-1", {0: 3, 2: 1})
    assert ReadPoint.parse("7-1").positions == {}
