"""The request service (router/service.py) on a real Redis and the default model's real
tokenizer, without Ray or HTTP: it authenticates, checks and admits a request into its
tenant's queue (idempotently), refuses a tenant over its quota with the right error, cancels,
reads a request's response stream back (each token once, resumable), and the scripts it runs
record the tenant's usage. No dispatcher loop runs: a test takes the grant itself, as a
dispatcher would, and writes the stream with the router's own ``ResponseStreams``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from replicas.engine.config import EngineConfig
from replicas.model_info import describe_model
from router.api.openai_models import ChatCompletionRequest, CompletionRequest
from router.dispatch import response_events
from router.dispatch.relay import Running
from router.dispatch.response_events import ChunkData, EndData
from router.dispatch.streams import Event, ReadPoint, ResponseStreams
from router.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    MIN_TOKENS_OVER_MAX_TOKENS,
    PAST_THE_STREAM,
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
)
from router.messages import Grant, RequestState
from router.service import RouterService, ServedModel
from router.state.redis_client import connect
from router.state.tenants import Tenant, TenantStore
from router.state.usage import UsageReader
from tests.router.factories import run

HOLDER = "router-a"


@pytest.fixture(scope="module")
def model() -> Any:
    return describe_model(EngineConfig())


Scenario = Callable[[RouterService, dict[str, str]], Awaitable[None]]


def serve(redis_url: str, model: Any, scenario: Scenario, *tenants: Tenant) -> None:
    """Run ``scenario`` with a service and a bearer header per tenant (default: "t")."""

    async def main() -> None:
        service = RouterService(connect(redis_url), ServedModel(model, replicas=None),  # type: ignore[arg-type]
                                HOLDER)
        service.mux.start()
        try:
            bearers = {}
            for tenant in tenants or (Tenant(id="t"),):
                await TenantStore(service.queues.scripts).add(tenant)
                created = await service.api_keys.create(tenant.id)
                bearers[tenant.id] = f"Bearer {created.secret}"
            await scenario(service, bearers)
        finally:
            await service.mux.stop()
            await service.client.aclose()

    run(main())


def chat(model: Any, text: str = "Hi", **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": model.served_model_name, "messages": [{"role": "user", "content": text}],
        **fields})


async def grant_one(service: RouterService) -> Grant:
    (grant,) = (await service.queues.grant(HOLDER, 1)).grants
    return grant


async def write(service: RouterService, grant: Grant, *chunks: tuple[int, ...]) -> None:
    """What a replica does: each chunk of choice 0 appended after the ones before it."""
    streams, position = ResponseStreams(service.queues.scripts), 0
    for token_ids in chunks:
        start, position = position, position + len(token_ids)
        data = response_events.chunk_data(f"<{len(token_ids)}>", list(token_ids), position, None)
        await streams.append(grant.lease, [Event(response_events.CHUNK, data, 0, position,
                                                 start)])


async def collect(events: AsyncIterator[tuple[str, ChunkData | EndData]]
                  ) -> list[tuple[str, ChunkData | EndData]]:
    return [item async for item in events]


def test_a_request_is_tokenized_checked_and_admitted_into_its_tenants_queue(
        redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        request = CompletionRequest.model_validate({
            "model": model.served_model_name, "prompt": [5, 6, 7], "max_tokens": 4})
        principal = await service.authenticate_to_submit(bearers["t"], request, None)
        submission = await service.submit(principal, request, None)

        assert (submission.tenant_id, submission.prompt_tokens, submission.max_tokens) == \
            ("t", 3, 4)
        assert submission.request_id.startswith("cmpl-") and not submission.is_duplicate
        record = await service.queues.get("t", submission.request_id)
        assert (record.state, record.prompt_tokens, record.max_tokens) == \
            (RequestState.QUEUED, 3, 4)
        grant = await grant_one(service)
        body = json.loads(grant.body)
        assert body["prompt_token_ids"] == [5, 6, 7] and body["sampling"]["max_tokens"] == 4
        shape = await service.shape_of("t", submission.request_id)
        assert not shape.is_chat and shape.request_id == submission.request_id
        # a chat's prompt is the model's template, tokenized on the router
        chat_sub = await service.submit(principal, chat(model, "Hello there", max_tokens=3), None)
        ids = service.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
        assert chat_sub.prompt_tokens == len(ids) > 3

    serve(redis_url, model, scenario)


def test_a_retry_with_the_same_idempotency_key_joins_the_request(redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        principal = await service.authenticate(bearers["t"])
        first = await service.submit(principal, chat(model, max_tokens=5), "key-1")
        again = await service.submit(principal, chat(model, max_tokens=5), "key-1")
        other = await service.submit(principal, chat(model, max_tokens=5), "key-2")

        assert again.request_id == first.request_id and again.is_duplicate
        assert other.request_id != first.request_id and not other.is_duplicate
        backlog = {b.tenant_id: b for b in await service.queues.backlog()}
        assert backlog["t"].num_queued == 2

    serve(redis_url, model, scenario)


def test_a_tenant_over_its_rpm_is_refused_429_unless_it_retries_a_request_it_has(
        redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        request = chat(model, max_tokens=5)
        principal = await service.authenticate_to_submit(bearers["t"], request, "key-1")
        await service.submit(principal, request, "key-1")

        with pytest.raises(RateLimitError) as refused:
            await service.authenticate_to_submit(bearers["t"], request, None)
        assert refused.value.status == 429 and refused.value.reason == "rpm"
        assert refused.value.retry_after_s > 0
        # the retry of the request it already has is let through, and joins it
        assert (await service.authenticate_to_submit(bearers["t"], request, "key-1")
                ).tenant_id == "t"
        with pytest.raises(RateLimitError):  # a new key is a new request: refused
            await service.authenticate_to_submit(bearers["t"], request, "key-2")

    serve(redis_url, model, scenario, Tenant(id="t", rpm=1))


def test_bad_keys_and_requests_are_refused_with_the_openai_error(redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        with pytest.raises(AuthenticationError) as unknown:
            await service.authenticate("Bearer fs-nope")
        assert unknown.value.status == 401
        principal = await service.authenticate(bearers["t"])
        context = service.context_tokens
        with pytest.raises(InvalidRequestError) as too_long:
            await service.submit(principal, chat(model, max_tokens=context), None)
        assert (too_long.value.param, too_long.value.code) == \
            ("max_tokens", CONTEXT_LENGTH_EXCEEDED)
        with pytest.raises(InvalidRequestError) as min_over:
            await service.submit(principal, chat(model, max_tokens=2, min_tokens=3), None)
        assert (min_over.value.param, min_over.value.code) == \
            ("min_tokens", MIN_TOKENS_OVER_MAX_TOKENS)
        with pytest.raises(InvalidRequestError) as out_of_vocab:
            await service.submit(principal, CompletionRequest.model_validate(
                {"model": model.served_model_name, "prompt": [1, service.tokenizer.vocab_size]}),
                None)
        assert out_of_vocab.value.param == "prompt"
        # nothing refused was queued
        assert all(b.num_queued == 0 for b in await service.queues.backlog())

    serve(redis_url, model, scenario)


def test_cancelling_a_queued_request_takes_it_out_and_ends_its_stream(
        redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        principal = await service.authenticate(bearers["t"])
        submission = await service.submit(principal, chat(model, max_tokens=5), None)
        await service.cancel("t", submission.request_id)

        record = await service.queues.get("t", submission.request_id)
        assert record.state is RequestState.CANCELLED
        assert (await service.queues.grant(HOLDER, 1)).grants == []
        ((_, end),) = await collect(service.events("t", submission.request_id))
        assert isinstance(end, EndData) and end.outcome == "cancelled"
        await service.cancel("t", "chatcmpl-unknown")  # logged, not raised

    serve(redis_url, model, scenario)


def test_cancelling_a_running_request_flags_it_and_aborts_its_local_relay(
        redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        principal = await service.authenticate(bearers["t"])
        submission = await service.submit(principal, chat(model, max_tokens=5), None)
        grant = await grant_one(service)
        running = Running(grant, 0, 0)
        service.default.dispatcher._running[grant.request_id] = running
        await service.cancel("t", submission.request_id)

        assert running.is_cancel_requested
        assert (await service.queues.get("t", submission.request_id)).is_cancel_requested

    serve(redis_url, model, scenario)


def test_the_stream_reads_back_each_token_once_with_ids_to_resume_from(
        redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        principal = await service.authenticate(bearers["t"])
        submission = await service.submit(principal, chat(model, max_tokens=5), None)
        rid = submission.request_id
        grant = await grant_one(service)
        await write(service, grant, (1, 2), (3,))
        await service.queues.complete(grant.lease, 7, 3, "stop",
                                      response_events.end_data("stop", 7, 3, 0))

        items = await collect(service.events("t", rid))
        assert [type(i).__name__ for _, i in items] == ["ChunkData", "ChunkData", "EndData"]
        assert [i.token_ids for _, i in items[:2]] == [[1, 2], [3]]  # type: ignore[union-attr]
        first_id = items[0][0]
        assert first_id.endswith(";2")  # the stream id and the position the client has
        # resumed after the first event: the rest, and only the rest
        point = await service.position("t", rid, first_id, "Last-Event-ID")
        rest = await collect(service.events("t", rid, point))
        assert [e for e, _ in rest] == [e for e, _ in items[1:]]
        # a client that already has token 3 (positions say so) is not sent it again
        skipped = await collect(service.events("t", rid, ReadPoint(positions={0: 3})))
        assert [type(i).__name__ for _, i in skipped] == ["EndData"]
        # what a tool-call parser reads again to stand where that client stands
        point = await service.position("t", rid, first_id, "Last-Event-ID")
        assert [c.token_ids for c in await service.chunks_before("t", rid, point)] == [[1, 2]]

        with pytest.raises(InvalidRequestError) as future:
            await service.position("t", rid, "99999999999999-0", "Last-Event-ID")
        assert future.value.code == PAST_THE_STREAM
        with pytest.raises(InvalidRequestError):
            await service.position("t", rid, "not-an-id", "Last-Event-ID")

    serve(redis_url, model, scenario)


def test_a_request_is_readable_by_its_own_tenant_only(redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        principal = await service.authenticate(bearers["a"])
        submission = await service.submit(principal, chat(model, max_tokens=5), None)
        assert (await service.shape_of("a", submission.request_id)).is_chat
        with pytest.raises(NotFoundError) as other:
            await service.shape_of("b", submission.request_id)
        assert other.value.status == 404

    serve(redis_url, model, scenario, Tenant(id="a"), Tenant(id="b"))


def test_a_served_request_is_recorded_in_its_tenants_usage(redis_url, model) -> None:
    async def scenario(service: RouterService, bearers: dict[str, str]) -> None:
        principal = await service.authenticate(bearers["t"])
        await service.submit(principal, chat(model, max_tokens=5), None)
        grant = await grant_one(service)
        await write(service, grant, (1, 2), (3,))
        await service.queues.complete(grant.lease, grant.prompt_tokens, 3, "stop",
                                      response_events.end_data("stop", grant.prompt_tokens,
                                                               3, 0))

        now_ms = int(time.time() * 1000)
        (row,) = await UsageReader(service.client).read(now_ms - 3_600_000, now_ms + 60_000,
                                                        ["t"], ("tenant", "model"))
        assert row.model == model.served_model_name
        assert row.counts["requests"] == 1 and row.counts["completion_tokens"] == 3
        assert row.counts["prompt_tokens"] == grant.prompt_tokens
        assert service.metrics.to_json()  # the admission was counted on this router

    serve(redis_url, model, scenario)
