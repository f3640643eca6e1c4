"""One trace per request through the real cluster, exported over OTLP/HTTP to the session's
receiver; the client's side is traced with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import statistics

import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import set_span_in_context

from cluster.benchmarks.otlp_receiver import OtlpReceiver, ReceivedSpan
from router.state.tenants import Tenant
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVER = "POST /v1/chat/completions"
ENGINE_SPANS = ("fairserve.engine.queue", "fairserve.prefill", "fairserve.decode")
TREE = (SERVER, "fairserve.queue", "fairserve.dispatch", *ENGINE_SPANS)


def _client_tracer() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    names = [s.name for s in spans]
    assert len(names) == len(set(names)), f"one span of each kind per request: {names}"
    return {s.name: s for s in spans}


def _complete_tree(trace_id: str):
    return lambda spans: {s.name for s in spans if s.trace_id == trace_id} >= set(TREE)


def test_one_trace_per_request_joins_the_clients(e2e: E2ECluster, otlp: OtlpReceiver) -> None:
    provider, exporter = _client_tracer()
    tracer = provider.get_tracer("test-client")
    with tracer.start_as_current_span("client request") as client_span:
        headers: dict[str, str] = {}
        propagate.inject(headers, context=set_span_in_context(client_span))
        response = e2e.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24, temperature=0.0, extra_headers=headers)
    (client,) = exporter.get_finished_spans()
    trace_id = format(client.context.trace_id, "032x")
    spans = _by_name([s for s in otlp.wait_for(_complete_tree(trace_id)) if s.trace_id == trace_id])
    assert set(spans) == set(TREE), "nothing else in the request's trace"
    server, queue, dispatch = spans[SERVER], spans["fairserve.queue"], spans["fairserve.dispatch"]

    # the tree: client -> server -> (queue, dispatch -> engine.queue, prefill, decode)
    assert server.parent_span_id == format(client.context.span_id, "016x")
    assert queue.parent_span_id == server.span_id
    assert dispatch.parent_span_id == server.span_id
    for name in ENGINE_SPANS:
        assert spans[name].parent_span_id == dispatch.span_id, name
    assert server.service == "fairserve-router" and spans["fairserve.decode"].service == \
        "fairserve-replica"

    # times: each phase follows the last, and together they are the request
    order = [queue, spans["fairserve.engine.queue"], spans["fairserve.prefill"],
             spans["fairserve.decode"]]
    for earlier, later in zip(order, order[1:], strict=False):
        assert earlier.end_ns <= later.start_ns + 1_000_000, (earlier.name, later.name)
    assert server.start_ns <= queue.start_ns and order[-1].end_ns <= server.end_ns
    assert dispatch.start_ns == queue.end_ns
    # What the phases leave out is the hops between router and replica (a Ray call there, the
    # first and last chunks back): a few ms on an idle machine, up to ~50 ms measured on a
    # loaded 2-core CI machine (45 ms of 741). The bound still catches a phase that lost its
    # time: 24 tokens of decode alone take ~0.5 s here.
    untraced_s = server.duration_s - sum(s.duration_s for s in order)
    assert 0 <= untraced_s <= max(0.1, 0.1 * server.duration_s), (server.duration_s, untraced_s)

    # attributes: the request, the usage of the response, the latencies
    usage = response.usage
    a = server.attributes
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.request.max_tokens"] == 24
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens_details.cached_tokens \
        == spans["fairserve.prefill"].attributes["fairserve.prefill.cached_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [response.choices[0].finish_reason]
    assert a["gen_ai.response.id"] == response.id
    assert a["http.response.status_code"] == 200
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
        spans["fairserve.prefill"].duration_s, abs=1e-3)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        spans["fairserve.decode"].duration_s, abs=1e-3)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(
        queue.duration_s + spans["fairserve.engine.queue"].duration_s, abs=1e-3)
    assert 0 < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"] <= \
        server.duration_s
    assert queue.attributes["fairserve.tenant"] == a["fairserve.tenant"] == "demo"
    assert queue.attributes["fairserve.queue.depth"] >= 1
    assert queue.attributes["fairserve.reserved_tokens"] == usage.prompt_tokens + 24
    assert dispatch.attributes["fairserve.delivery"] == 1
    assert dispatch.attributes["fairserve.replica.id"] == \
        spans["fairserve.decode"].attributes["fairserve.replica.id"]
    assert dispatch.attributes["fairserve.outcome"] == "completed"
    assert spans["fairserve.decode"].attributes["gen_ai.usage.output_tokens"] == \
        usage.completion_tokens
    assert spans["fairserve.prefill"].attributes["fairserve.prefill.chunks"] >= 1


def test_a_request_without_traceparent_gets_its_own_trace(e2e: E2ECluster,
                                                          otlp: OtlpReceiver) -> None:
    stream = e2e.client().completions.create(model=MODEL, prompt="The sky is", max_tokens=8,
                                             stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    request_id = chunks[0].id

    def tagged(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.attributes.get("fairserve.request_id") == request_id]

    spans = tagged(otlp.wait_for(lambda spans: len(tagged(spans)) >= 2))
    (trace_id,) = {s.trace_id for s in spans}
    names = {s.name for s in otlp.wait_for(
        lambda all_spans: {s.name for s in all_spans if s.trace_id == trace_id} >= {
            "POST /v1/completions", "fairserve.queue", "fairserve.dispatch", *ENGINE_SPANS})
        if s.trace_id == trace_id}
    assert names == {"POST /v1/completions", "fairserve.queue", "fairserve.dispatch",
                     *ENGINE_SPANS}
    (server,) = [s for s in spans if s.name == "POST /v1/completions"]
    assert server.parent_span_id == "", "a root span"
    assert chunks[-1].usage is not None
    timings = chunks[-1].usage.model_extra["timings_ms"]
    assert set(timings) == {"queue", "engine_queue", "prefill", "decode"}


def test_saturated_cluster_queue_time_grows_while_prefill_and_decode_stay_flat(
        e2e: E2ECluster, otlp: OtlpReceiver) -> None:
    """Three times the cluster's slots at once: the last third waits in the queue for two
    rounds while its prefill and decode take as long as the first third's."""
    key = e2e.add_tenant(Tenant(id="flood", max_queued=500))
    num = 3 * 32

    async def one(client, i: int) -> str:
        response = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to ten, case {i}."}],
            max_tokens=8, extra_body={"min_tokens": 8}, temperature=0.0)
        return response.id

    async def flood() -> list[str]:
        async with e2e.async_client(key) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num)))

    ids = set(asyncio.run(flood()))

    def of_flood(spans: list[ReceivedSpan]) -> dict[str, dict[str, ReceivedSpan]]:
        traces: dict[str, str] = {s.trace_id: s.attributes["fairserve.request_id"]
                                  for s in spans if s.name == "fairserve.dispatch"
                                  and s.attributes.get("fairserve.request_id") in ids}
        out: dict[str, dict[str, ReceivedSpan]] = {}
        for s in spans:
            if s.trace_id in traces:
                out.setdefault(traces[s.trace_id], {})[s.name] = s
        return {rid: t for rid, t in out.items() if set(TREE) <= set(t)}

    traces = of_flood(otlp.wait_for(lambda spans: len(of_flood(spans)) == num, timeout_s=60))
    by_grant = sorted(traces.values(), key=lambda t: t["fairserve.queue"].end_ns)
    third = num // 3
    first, last = by_grant[:third], by_grant[-third:]

    def median(group, name: str) -> float:
        return statistics.median(t[name].duration_s for t in group)

    def engine(group) -> float:
        return statistics.median(t["fairserve.prefill"].duration_s +
                                 t["fairserve.decode"].duration_s for t in group)

    queue_first, queue_last = median(first, "fairserve.queue"), median(last, "fairserve.queue")
    print(f"\nqueue p50: first third {queue_first * 1e3:.0f} ms, last third "
          f"{queue_last * 1e3:.0f} ms; prefill+decode p50: first {engine(first) * 1e3:.0f} ms, "
          f"last {engine(last) * 1e3:.0f} ms")
    assert queue_last > 1.5 * engine(last), "the last third waited longer than it ran"
    assert queue_last > 5 * queue_first + 0.5
    assert engine(last) < 2 * engine(first) + 0.2, "prefill + decode stayed flat"
