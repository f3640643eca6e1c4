"""Property test of the request lifecycle over random interleavings (hypothesis, real Redis):
no request is granted twice while its lease lives, stale holders are fenced, and every
admitted request ends exactly once (completed, cancelled or dead-lettered)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import QueueSettings
from router.errors import LeaseLostError
from router.messages import CancelOutcome, Grant, RequestState
from router.state import keys
from router.state.tenants import Tenant
from tests.router.factories import ManualClock, harness, make_request, run

LEASE_MS = 1_000
QUEUE_SETTINGS = QueueSettings(lease_ms=LEASE_MS, max_deliveries=3)
NUM_TENANTS = 3

step = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, NUM_TENANTS - 1)),
    st.tuples(st.just("grant"), st.integers(1, 5)),
    st.tuples(st.just("complete"), st.integers(0, 50)),
    st.tuples(st.just("requeue"), st.integers(0, 50)),
    st.tuples(st.just("renew"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 200)),
    st.tuples(st.just("tick"), st.integers(100, 1_500)),  # then the reaper runs
    st.tuples(st.just("stale"), st.integers(0, 50)),  # a holder that lost its lease acts
)


class Model:
    """What the test knows: ids admitted, leases it holds, leases it lost, ends it caused."""

    def __init__(self) -> None:
        self.admitted: list[tuple[str, str]] = []
        self.held: dict[tuple[str, str], Grant] = {}
        self.lost: list[Grant] = []
        self.ended_by_us: dict[tuple[str, str], str] = {}

    def pick(self, index: int) -> Grant | None:
        if not self.held:
            return None
        return list(self.held.values())[index % len(self.held)]


async def _apply(h, clock: ManualClock, model: Model, op: str, arg: int) -> None:
    if op == "admit":
        rid = f"r{len(model.admitted)}"
        await h.queues.admit(make_request(f"t{arg}", rid, prompt_tokens=5 + arg, max_tokens=9))
        model.admitted.append((f"t{arg}", rid))
    elif op == "grant":
        # one holder id for all grants: a dispatcher restarted under the same name is fenced by
        # the attempt number alone
        for g in (await h.queues.grant("d", arg)).grants:
            ident = (g.tenant_id, g.request_id)
            assert ident not in model.held, f"{ident} granted twice while its lease lives"
            assert ident not in model.ended_by_us, f"{ident} granted after it ended"
            model.held[ident] = g
    elif op == "tick":
        clock.advance(arg)
        await h.queues.reap()
        # every lease whose deadline passed is gone: the reaper requeued or dead-lettered it
        for ident, g in list(model.held.items()):
            if g.lease_deadline_ms <= clock.now_ms:
                model.lost.append(model.held.pop(ident))
    else:
        await _apply_other(h, model, op, arg)


async def _apply_other(h, model: Model, op: str, arg: int) -> None:
    if op == "stale":
        # prefer a lost lease whose request was granted again: only the attempt tells them apart
        again = [g for g in model.lost if (g.tenant_id, g.request_id) in model.held]
        candidates = again or model.lost
        if candidates:
            g = candidates[arg % len(candidates)]
            try:
                await h.queues.complete(g.lease, 1, 1, "stop")
            except LeaseLostError:
                return
            raise AssertionError(f"stale lease on {g.request_id} attempt {g.lease.attempt} "
                                 "completed")
    elif op == "cancel":
        if model.admitted:
            ident = model.admitted[arg % len(model.admitted)]
            outcome = await h.queues.cancel(*ident)
            if outcome == CancelOutcome.CANCELLED:
                assert ident not in model.held and ident not in model.ended_by_us
                model.ended_by_us[ident] = "cancelled"
    else:
        await _apply_to_held(h, model, op, arg)


async def _apply_to_held(h, model: Model, op: str, arg: int) -> None:
    g = model.pick(arg)
    if g is None:
        return
    ident = (g.tenant_id, g.request_id)
    if op == "renew":
        status = await h.queues.renew(g.lease)
        model.held[ident] = Grant(g.lease, status.deadline_ms, g.body, g.meta, g.prompt_tokens,
                                  g.max_tokens, g.created_ms, g.grant_seq)
    elif op == "complete":
        await h.queues.complete(g.lease, g.prompt_tokens, 3, "stop")
        del model.held[ident]
        assert ident not in model.ended_by_us
        model.ended_by_us[ident] = "completed"
    elif op == "requeue":
        state = await h.queues.requeue(g.lease, "replica_died")
        del model.held[ident]
        if state == RequestState.DEAD:
            model.ended_by_us[ident] = "dead"


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=80))
def test_every_admitted_request_ends_exactly_once(redis_client, redis_url, steps) -> None:
    redis_client.flushall()

    async def scenario() -> None:
        clock = ManualClock()
        async with harness(redis_url, clock, QUEUE_SETTINGS) as h:
            for i in range(NUM_TENANTS):
                await h.tenants.add(Tenant(id=f"t{i}", weight=i + 1))
            model = Model()
            for op, arg in steps:
                await _apply(h, clock, model, op, arg)
            # drain: complete what is held, then grant and complete until nothing is left
            for _ in range(1_000):
                while model.held:
                    await _apply_to_held(h, model, "complete", 0)
                await _apply(h, clock, model, "grant", 5)
                if not model.held and sum([await h.queues.depth(f"t{i}")
                                           for i in range(NUM_TENANTS)]) == 0:
                    break
            assert await h.queues.num_leased() == 0
            for ident in model.admitted:
                record = await h.queues.get(*ident)
                assert record.state.is_terminal, (ident, record.state)
                if ident in model.ended_by_us:
                    assert record.state.value == model.ended_by_us[ident]
                # exactly one terminal event on its stream: the one end transition
                events = await h.client.xrange(keys.stream(*ident))
                terminal = [e for _, e in events if e[b"type"] in (b"end", b"error")]
                assert len(terminal) == 1, (ident, events)
                assert await h.client.ttl(keys.request(*ident)) > 0

    run(scenario())
