"""Grants, leases, renewal, completion, requeue, the reaper, dead letters, cancellation and
response streams."""

from __future__ import annotations

import pytest

from router.config import QueueSettings
from router.dispatch.streams import Event
from router.errors import LeaseLostError, NotFoundError, StreamGapError
from router.messages import AdmitRequest, CancelOutcome, RequestState
from router.state import keys
from router.state.tenants import Tenant
from tests.router.factories import Harness, ManualClock, add_tenants, harness, make_request, run

SETTINGS = QueueSettings(lease_ms=1_000, max_deliveries=2)


def test_grant_needs_free_capacity_and_hands_out_at_most_that(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            for i in range(5):
                await h.queues.admit(make_request("acme", f"r{i}"))
            assert (await h.queues.grant("d", free_slots=0)).grants == []
            batch = await h.queues.grant("d", free_slots=2)
            assert [g.request_id for g in batch.grants] == ["r0", "r1"]
            assert [g.lease.attempt for g in batch.grants] == [1, 1]
            batch = await h.queues.grant("d", free_slots=10, max_grants=1)
            assert [g.request_id for g in batch.grants] == ["r2"]
            assert await h.queues.depth("acme") == 2 and await h.queues.num_leased() == 3
            record = await h.queues.get("acme", "r0")
            assert record.state == RequestState.LEASED and record.holder == "d"

    run(scenario())


def test_expired_lease_is_reaped_to_the_head_and_the_old_holder_is_fenced(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock, SETTINGS) as h:
            await add_tenants(h, Tenant(id="acme"))
            for i in range(3):
                await h.queues.admit(make_request("acme", f"r{i}"))
            (first,) = (await h.queues.grant("old", free_slots=1)).grants
            clock.advance(999)
            assert (await h.queues.reap()).num_requeued == 0  # not yet expired
            await h.queues.renew(first.lease)  # renewed: now good until +1000 from here
            clock.advance(999)
            assert (await h.queues.reap()).num_requeued == 0
            clock.advance(2)
            assert (await h.queues.reap()).num_requeued == 1
            assert await h.queues.queued_ids("acme") == ["r0", "r1", "r2"]  # back at the head
            # the same holder id again (a restarted dispatcher): the attempt number alone fences it
            (again,) = (await h.queues.grant("old", free_slots=1)).grants
            assert again.request_id == "r0" and again.lease.attempt == 2
            for stale in (h.queues.renew(first.lease),
                          h.queues.complete(first.lease, 10, 5, "stop"),
                          h.queues.requeue(first.lease, "replica_died"),
                          h.streams.append(first.lease, [Event("chunk", "dup")])):
                with pytest.raises(LeaseLostError):
                    await stale
            await h.streams.append(again.lease, [Event("chunk", "ok")])
            assert await h.queues.complete(again.lease, 10, 5, "stop") == 15
            events = [e async for e in h.streams.read("acme", "r0")]
            assert [(e.type, e.data) for e in events] == [("chunk", "ok"), ("end", "{}")]

    run(scenario())


def test_requeue_then_dead_letter_past_max_deliveries(redis_url) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock, SETTINGS) as h:
            await add_tenants(h, Tenant(id="acme", daily_tokens=10_000))
            await h.queues.admit(make_request("acme", "r", prompt_tokens=10, max_tokens=20))
            (g1,) = (await h.queues.grant("d", 1)).grants
            assert await h.queues.requeue(g1.lease, "replica_died") == RequestState.QUEUED
            (g2,) = (await h.queues.grant("d", 1)).grants
            assert g2.lease.attempt == 2
            clock.advance(5_000)
            result = await h.queues.reap()
            assert (result.num_requeued, result.num_dead) == (0, 1)
            record = await h.queues.get("acme", "r")
            assert record.state == RequestState.DEAD and record.end_reason == "lease_expired"
            assert await h.client.zscore(keys.dead("acme"), "r") is not None
            assert await h.client.ttl(keys.dead("acme")) > 0
            assert await h.client.ttl(keys.request("acme", "r")) > 0
            day = clock.now_ms // 86_400_000
            assert int(await h.client.get(keys.budget("acme", day))) == 0  # refunded in full
            events = [e async for e in h.streams.read("acme", "r")]
            assert events[-1].type == "error" and "dead" in events[-1].data
            assert await h.queues.num_leased() == 0 and await h.queues.depth("acme") == 0

    run(scenario())


def test_cancel_queued_leaves_the_queue_and_running_is_flagged(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            for i in range(3):
                await h.queues.admit(make_request("acme", f"r{i}"))
            (running,) = (await h.queues.grant("d", 1)).grants
            assert await h.queues.cancel("acme", "r1") == CancelOutcome.CANCELLED
            assert await h.queues.queued_ids("acme") == ["r2"]
            events = [e async for e in h.streams.read("acme", "r1")]
            assert [e.type for e in events] == ["end"] and "cancelled" in events[0].data
            assert await h.queues.cancel("acme", "r0") == CancelOutcome.FLAGGED
            assert (await h.queues.renew(running.lease)).is_cancel_requested
            status = await h.streams.append(running.lease, [Event("chunk", "x")])
            assert status.is_cancel_requested
            await h.queues.complete(running.lease, 10, 1, "abort", outcome=RequestState.CANCELLED)
            assert await h.queues.cancel("acme", "r0") == CancelOutcome.ALREADY_ENDED
            with pytest.raises(NotFoundError):
                await h.queues.cancel("acme", "nope")
            # the cancelled request is never granted
            batch = await h.queues.grant("d", 10)
            assert [g.request_id for g in batch.grants] == ["r2"]

    run(scenario())


def test_stream_resumes_from_the_last_event_id(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r"))
            (g,) = (await h.queues.grant("d", 1)).grants
            await h.streams.append(g.lease, [Event("chunk", "a"), Event("chunk", "b")])
            await h.streams.append(g.lease, [Event("chunk", "c")])
            assert await h.client.ttl(keys.stream("acme", "r")) == keys.STREAM_IDLE_TTL_S
            await h.queues.complete(g.lease, 10, 3, "stop", '{"usage": 13}')
            events = [e async for e in h.streams.read("acme", "r")]
            assert [e.data for e in events] == ["a", "b", "c", '{"usage": 13}']
            resumed = [e async for e in h.streams.read("acme", "r", after=events[1].event_id)]
            assert [e.data for e in resumed] == ["c", '{"usage": 13}']
            assert 0 < await h.client.ttl(keys.stream("acme", "r")) <= keys.RESUME_WINDOW_S
            with pytest.raises(NotFoundError):  # other tenants' request ids are invisible
                async for _ in h.streams.read("beta", "r"):
                    pass

    run(scenario())


def test_reader_blocks_until_the_dispatcher_writes(redis_url) -> None:
    import asyncio

    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r"))

            async def reader() -> list[str]:
                return [e.data async for e in h.streams.read("acme", "r", idle_timeout_s=10)]

            task = asyncio.create_task(reader())
            await asyncio.sleep(0.2)
            assert not task.done()
            (g,) = (await h.queues.grant("d", 1)).grants
            await h.streams.append(g.lease, [Event("chunk", "hi")])
            await h.queues.complete(g.lease, 1, 1, "stop", "done")
            assert await asyncio.wait_for(task, 5) == ["hi", "done"]

    run(scenario())


def test_scripts_reload_after_the_server_forgets_them(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "a"))
            await h.client.script_flush()
            await h.queues.admit(make_request("acme", "b"))
            await h.client.script_flush()
            results = await h.queues.admit_many([make_request("acme", "c"),
                                                 make_request("acme", "d")])
            assert [r.queue_depth for r in results] == [3, 4]
            assert await h.queues.queued_ids("acme") == ["a", "b", "c", "d"]

    run(scenario())


def test_malformed_queue_entries_are_skipped_with_a_warning_not_a_crash(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            for i in range(3):
                await h.queues.admit(make_request("acme", f"r{i}"))
            await h.client.delete(keys.request("acme", "r0"))  # an id with no record
            await h.client.hset(keys.request("acme", "r1"), "cost", "NaN?")
            batch = await h.queues.grant("d", 10)
            assert [g.request_id for g in batch.grants] == ["r2"]
            assert len(batch.warnings) == 2 and all("acme" in w for w in batch.warnings)
            assert (await h.queues.get("acme", "r1")).state == RequestState.DEAD

    run(scenario())


def test_grants_never_exceed_the_cluster_capacity_across_dispatchers(redis_url) -> None:
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            for i in range(10):
                await h.queues.admit(make_request("acme", f"r{i}"))
            first = (await h.queues.grant("d1", 10, capacity=3)).grants
            assert len(first) == 3
            assert (await h.queues.grant("d2", 10, capacity=3)).grants == []
            await h.queues.complete(first[0].lease, 10, 5, "stop")
            assert len((await h.queues.grant("d2", 10, capacity=3)).grants) == 1
            assert await h.queues.num_leased() == 3
            assert len((await h.queues.grant("d2", 10)).grants) == 6  # no capacity: free slots

    run(scenario())


def test_a_token_chunk_is_written_once_whoever_writes_it_again(redis_url) -> None:
    """Appends are fenced by position: a migrated or revived writer that sends tokens the
    client already has writes nothing; other choices and unfenced events are not affected."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r"))
            (g,) = (await h.queues.grant("d", 1)).grants
            await h.streams.append(g.lease, [Event("chunk", "a", 0, 1), Event("chunk", "bc", 0, 3),
                                             Event("chunk", "x", 1, 1)])
            # a second writer replays positions 1..3 of choice 0, then goes on
            await h.streams.append(g.lease, [Event("chunk", "a", 0, 1), Event("chunk", "bc", 0, 3),
                                             Event("chunk", "d", 0, 4), Event("chunk", "x", 1, 1),
                                             Event("note", "unfenced")])
            await h.queues.complete(g.lease, 10, 5, "stop")
            events = [e async for e in h.streams.read("acme", "r")]
            assert [e.data for e in events[:-1]] == ["a", "bc", "x", "d", "unfenced"]

    run(scenario())


def test_only_the_named_writer_appends_and_a_new_grant_names_none(redis_url) -> None:
    """The lease holder names the call that may write (a replica appends itself); the call it
    gave up on is refused even with the right lease, a cancel shows in the naming, and a
    takeover starts with no writer named."""
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock, SETTINGS) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r"))
            (g,) = (await h.queues.grant("d", 1)).grants
            assert not (await h.streams.name_writer(g.lease, "1.0")).is_cancel_requested
            await h.streams.append(g.lease, [Event("chunk", "a", 0, 1)], "1.0")
            for wrong in ("", "1.1"):
                with pytest.raises(LeaseLostError, match="another writer"):
                    await h.streams.append(g.lease, [Event("chunk", "b", 0, 2)], wrong)
            await h.streams.name_writer(g.lease, "")  # the holder fences the call it gave up on
            with pytest.raises(LeaseLostError, match="another writer"):
                await h.streams.append(g.lease, [Event("chunk", "b", 0, 2)], "1.0")
            await h.streams.name_writer(g.lease, "1.1")
            await h.streams.append(g.lease, [Event("chunk", "b", 0, 2)], "1.1")
            assert await h.queues.cancel("acme", "r") == CancelOutcome.FLAGGED
            assert (await h.streams.name_writer(g.lease, "1.2")).is_cancel_requested
            clock.advance(SETTINGS.lease_ms + 1)
            assert (await h.queues.reap()).num_requeued == 1
            with pytest.raises(LeaseLostError):  # the old lease names no one any more
                await h.streams.name_writer(g.lease, "1.3")
            (again,) = (await h.queues.grant("e", 1)).grants
            await h.streams.append(again.lease, [Event("chunk", "c", 0, 3)])  # none named yet
            record = await h.queues.get("acme", "r")
            assert record.state == RequestState.LEASED

    run(scenario())


def test_an_ended_request_keeps_no_body_and_is_still_known_to_a_retry(redis_url) -> None:
    """Completed, cancelled while queued and dead-lettered requests drop their body (the
    prompt is most of a request's bytes, and nothing reads it once the request has ended);
    an idempotent retry is still recognised by the body's digest."""
    from router.errors import IdempotencyKeyReusedError

    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock, SETTINGS) as h:
            await add_tenants(h, Tenant(id="acme"))
            for rid in ("done", "gone", "dead"):
                await h.queues.admit(make_request("acme", rid))
            assert await h.client.hexists(keys.request("acme", "done"), "body")
            (done,) = (await h.queues.grant("d", 1)).grants
            await h.queues.complete(done.lease, 10, 5, "stop")
            assert await h.queues.cancel("acme", "gone") == CancelOutcome.CANCELLED
            for _ in range(SETTINGS.max_deliveries):
                (g,) = (await h.queues.grant("d", 1)).grants
                clock.advance(SETTINGS.lease_ms + 1)
                await h.queues.reap()
            for rid, state in (("done", RequestState.COMPLETED), ("gone", RequestState.CANCELLED),
                               ("dead", RequestState.DEAD)):
                assert (await h.queues.get("acme", rid)).state == state
                assert not await h.client.hexists(keys.request("acme", rid), "body"), rid
            again = await h.queues.admit(make_request("acme", "done"))
            assert again.is_duplicate and again.state == RequestState.COMPLETED
            with pytest.raises(IdempotencyKeyReusedError):
                await h.queues.admit(make_request("acme", "done", max_tokens=21))

    run(scenario())


def test_what_outlives_a_served_request_does_not_grow_with_its_prompt(redis_url) -> None:
    """A served request's record (kept for the resume window, for resumes, idempotent retries
    and lookups) is the same size for a 1,500- and a 15,000-token prompt: about 2.6 KB (Redis's
    hash-table encoding of its ~25 fields; the two differ by the allocator's rounding of their
    numbers' digits at most). After the window only an Idempotency-Key's digest stays
    (test_admission.py)."""
    import json as json_module

    from router.api.shaper import Shape
    from router.state.keys import check_request_id
    from router.telemetry.tracing import encode_meta

    async def served(h: Harness, num_prompt: int) -> tuple[int, int]:
        rid = check_request_id(f"chatcmpl-{num_prompt:032d}")
        body = json_module.dumps({"prompt_token_ids": list(range(10_000, 10_000 + num_prompt)),
                                  "sampling": {"max_tokens": 64, "temperature": 0.7}})
        shape = Shape(rid, True, "SmolLM2-135M-Instruct", 1_800_000_000, num_prompt, 1, True)
        meta = encode_meta({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                            "shape": shape.to_wire()}, 1_800_000_000_000_000_000)
        await h.queues.admit(AdmitRequest("acme", rid, num_prompt, 64, body, meta))
        (g,) = (await h.queues.grant("d", 1)).grants
        before = await h.client.memory_usage(keys.request("acme", rid), samples=0) or 0
        await h.queues.complete(g.lease, num_prompt, 64, "length")
        return before, await h.client.memory_usage(keys.request("acme", rid), samples=0) or 0

    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            (small_running, small), (large_running, large) = [
                await served(h, n) for n in (1_500, 15_000)]
            assert small_running > 8_000 and large_running > 80_000
            assert abs(small - large) <= 64 and large < 3_000, (small, large)

    run(scenario())


def test_a_router_shutdown_does_not_count_as_a_delivery(redis_url) -> None:
    """Rolling restarts hand a long request back again and again: those deliveries are
    forgiven, so it is not dead-lettered for them; a failure still counts (max_deliveries 2)."""
    async def scenario() -> None:
        async with harness(redis_url, ManualClock(), SETTINGS) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "long"))
            for attempt in range(1, 6):  # five restarts
                (g,) = (await h.queues.grant(f"router-{attempt}", 1)).grants
                assert g.lease.attempt == attempt  # the attempt still fences the old holder
                assert await h.queues.requeue(g.lease, "router shutdown",
                                              is_holder_stopping=True) == RequestState.QUEUED
            (g,) = (await h.queues.grant("d", 1)).grants
            assert await h.queues.requeue(g.lease, "replica_died") == RequestState.QUEUED
            (g,) = (await h.queues.grant("d", 1)).grants
            assert await h.queues.requeue(g.lease, "replica_died") == RequestState.DEAD

    run(scenario())


def test_a_dead_letter_is_charged_what_it_streamed(redis_url) -> None:
    """A request dead-lettered after tokens went out is charged its prompt and those tokens
    (each once, whichever holder wrote them); one that sent nothing is refunded in full."""
    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock, SETTINGS) as h:
            await add_tenants(h, Tenant(id="acme", daily_tokens=10_000))
            await h.queues.admit(make_request("acme", "r", prompt_tokens=10, max_tokens=20))
            for _ in range(SETTINGS.max_deliveries):
                (g,) = (await h.queues.grant("d", 1)).grants
                # each holder writes 3 tokens of choice 0 from the start; 1 of them is new
                await h.streams.append(g.lease, [Event("chunk", "ab", 0, 2),
                                                 Event("chunk", "c", 0, g.lease.attempt + 1)])
                clock.advance(SETTINGS.lease_ms + 1)
                await h.queues.reap()
            assert (await h.queues.get("acme", "r")).state == RequestState.DEAD
            day = clock.now_ms // 86_400_000
            assert int(await h.client.get(keys.budget("acme", day))) == 10 + 3

    run(scenario())


def test_a_chunk_past_the_streams_position_is_a_gap_and_completion_checks_the_count(
        redis_url) -> None:
    """A Redis failover can lose a stream's last chunks (replication is asynchronous): the
    next chunk then starts past what its choice holds and is refused (the events before it in
    the batch are written), and a completion that expects more output tokens than the stream
    holds changes nothing; both raise ``StreamGapError``, and the dispatcher has the tokens
    made again (a migration)."""
    async def scenario() -> None:
        async with harness(redis_url) as h:
            await add_tenants(h, Tenant(id="acme"))
            await h.queues.admit(make_request("acme", "r"))
            (g,) = (await h.queues.grant("d", 1)).grants
            await h.streams.append(g.lease, [Event("chunk", "a", 0, 1, 0),
                                             Event("chunk", "bc", 0, 3, 1)])
            with pytest.raises(StreamGapError, match="lost in a Redis failover"):
                await h.streams.append(g.lease, [Event("chunk", "d", 0, 4, 3),
                                                 Event("chunk", "f", 0, 6, 5),
                                                 Event("chunk", "g", 0, 7, 6)])
            # the writer that resumes from the stream's position goes on from there
            await h.streams.append(g.lease, [Event("chunk", "e", 0, 5, 4)])
            with pytest.raises(StreamGapError, match="holds 5 of its 7"):
                await h.queues.complete(g.lease, 10, 7, "stop", must_hold=7)
            assert (await h.queues.get("acme", "r")).state == RequestState.LEASED
            await h.queues.complete(g.lease, 10, 5, "stop", must_hold=5)
            events = [e async for e in h.streams.read("acme", "r")]
            assert [e.data for e in events[:-1]] == ["a", "bc", "d", "e"]

    run(scenario())
