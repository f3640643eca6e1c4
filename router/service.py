"""The router's request path, below HTTP: authenticate, validate against the model and the
tenant, admit into the tenant's queue, and read the response stream back.

One ``RouterService`` per router replica. It owns the Redis client and the dispatcher loop
(``router/dispatch/dispatcher.py``); the HTTP layer (``router/api/routes.py``) turns its results
into OpenAI responses, and ``router/api/error_handlers.py`` its errors. Admissions wake the local dispatcher directly and the others through the
Redis wake channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from replicas.protocol import ModelInfo, carrier
from router.admin.app import admin_app
from router.admin.server import AdminServer
from router.api.openai_models import ChatCompletionRequest, CompletionRequest
from router.api.openapi import EVENT_ID_PATTERN, DeploymentLimits
from router.api.prompt_tokenizer import PromptTokenizer
from router.api.sampling import check_sampling, sampling_wire, stream_max_tokens
from router.api.shaper import Shape
from router.api.tenant_gate import KnownKeys
from router.api.tools import chat_prompt, check_references
from router.config import ApiSettings, QueueSettings
from router.dispatch import response_events
from router.dispatch.dispatcher import Dispatcher, DispatchSettings
from router.dispatch.relay import ReplicaPool
from router.dispatch.stream_mux import StreamMux
from router.dispatch.streams import START, ReadPoint
from router.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    MIN_TOKENS_OVER_MAX_TOKENS,
    PAST_THE_STREAM,
    InvalidRequestError,
    NotFoundError,
    NotReplicatedError,
    RateLimitError,
    RouterError,
)
from router.messages import (
    AdmitRequest,
    CancelOutcome,
    Reader,
    ReaderKind,
    StreamEvent,
)
from router.state import keys, nodes
from router.state.adapters import Adapter, AdapterRegistry
from router.state.api_keys import ApiKeys, Principal
from router.state.audit import AuditLog
from router.state.capacity import CapacityView
from router.state.queues import TenantQueues
from router.state.readers import ReaderLeases, lease_end_ms
from router.state.responses import ResponseStore
from router.state.scripts import Scripts
from router.telemetry.metrics import (
    SNAPSHOT_S,
    SNAPSHOT_TTL_S,
    ClusterState,
    MetricsStore,
    autoscaler_state,
    exposition,
)
from router.telemetry.metrics_server import MetricsServer
from router.telemetry.tracing import OFF, Tracing, decode_meta, encode_meta, now_ns

logger = logging.getLogger(__name__)

IDEMPOTENCY_KEY_MAX_CHARS = 255
# a prompt with more characters than this many per context token is refused untokenized (a
# token of common tokenizers is 3-5 characters of English; 32 leaves room for any real text)
MAX_PROMPT_CHARS_PER_TOKEN = 32
TOKENIZE_OFF_LOOP_CHARS = 4_000  # a longer prompt is tokenized on a worker thread
T = TypeVar("T")
EVENT_ID = re.compile(EVENT_ID_PATTERN)


def _id_order(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)
WAKE_READ_S = 1.0


@dataclass(frozen=True, slots=True)
class Submission:
    """An admitted request (new, or the existing one an Idempotency-Key joined)."""

    tenant_id: str
    request_id: str
    prompt_tokens: int
    max_tokens: int
    is_duplicate: bool
    queue_depth: int | None
    shape: Shape  # what its responses look like (stored with it: router/api/shaper.py)
    reader: Reader  # the client's, attached (the caller detaches it: RouterService.detach)
    # x-ratelimit-* of the tenant after its admission (router/state/rate_limits.py)
    rate_limit_headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouterOptions:
    api: ApiSettings = field(default_factory=ApiSettings)
    queues: QueueSettings = field(default_factory=QueueSettings)
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    tracing: Tracing = OFF


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A base model this router serves: what it knows of it, its replicas, and its pool (its
    queues in Redis, ``router/state/keys.py``; "": the default model's)."""

    info: ModelInfo
    replicas: ReplicaPool
    pool: str = ""
    aliases: tuple[str, ...] = ()


@dataclass(slots=True)
class _Model:
    """A served model at run time: its tokenizer and its dispatcher."""

    served: ServedModel
    tokenizer: PromptTokenizer
    dispatcher: Dispatcher

    @property
    def name(self) -> str:
        return self.served.info.served_model_name

    @property
    def pool(self) -> str:
        return self.served.pool

    @property
    def context_tokens(self) -> int:
        """Longest prompt + output a request may have."""
        info = self.served.info
        return min(info.max_model_len, info.kv_capacity_tokens)


class RouterService:
    def __init__(self, client: aioredis.Redis, models: ServedModel | list[ServedModel],
                 holder: str, options: RouterOptions | None = None) -> None:
        options = options or RouterOptions()
        served = [models] if isinstance(models, ServedModel) else list(models)
        self.client = client
        self.api = options.api
        self.tracing = options.tracing
        scripts = Scripts(client, resume_window_s=options.queues.resume_window_s,
                          usage_retention_days=options.queues.usage_retention_days)
        self.known_keys = KnownKeys()  # the tenant gate's: keys that authenticated here
        self.api_keys = ApiKeys(scripts, self.known_keys)
        self.queues = TenantQueues(scripts, options.queues)
        self.mux = StreamMux(client)
        self.readers = ReaderLeases(self.queues, int(self.api.detach_grace_s * 1000))
        self.responses = ResponseStore(client, self.api.responses)  # POST /v1/responses
        self.metrics = MetricsStore()
        self.capacity = CapacityView(client, options.dispatch.capacity_refresh_s)  # all models
        tokenizers: dict[bytes, PromptTokenizer] = {}  # models of one tokenizer share it
        self.models: list[_Model] = []
        for i, model in enumerate(served):
            digest = hashlib.sha256(json.dumps(sorted(
                (k, v.hex()) for k, v in model.info.tokenizer_files.items())).encode()).digest()
            if digest not in tokenizers:
                tokenizers[digest] = PromptTokenizer(model.info)
            dispatcher = Dispatcher(
                self.queues, model.replicas, holder, options.dispatch, options.tracing,
                on_migration=lambda tenant, reason: self.metrics.inc("fairserve_migrations",
                                                                     (tenant, reason)),
                pool=model.pool, model=model.info.served_model_name, reaps=i == 0)
            self.models.append(_Model(model, tokenizers[digest], dispatcher))
        self._by_name = {name: m for m in self.models
                         for name in (m.name, *m.served.aliases)}
        self.default = self.models[0]
        self.model = self.default.served.info  # the default model's (the OpenAPI document)
        self.tokenizer = self.default.tokenizer
        self.adapters = AdapterRegistry(
            client, {m.name: m.served.info.adapters for m in self.models},
            frozenset(a for m in self.models for a in m.served.aliases))
        self.holder = holder
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics_server = (MetricsServer(self.metrics_exposition, self.api.metrics_host,
                                             self.api.metrics_port)
                               if self.api.metrics_port is not None else None)
        self.admin_server = (AdminServer(admin_app(scripts, AuditLog(
            client, options.queues.audit_retention_days, options.queues.audit_max_entries)),
            self.api.admin_host, self.api.admin_port)
            if self.api.admin_port is not None else None)

    @property
    def dispatchers(self) -> list[Dispatcher]:
        return [m.dispatcher for m in self.models]

    def model_named(self, name: str) -> _Model:
        """A base model by its served name ("": the default one)."""
        return self._by_name.get(name, self.default)

    async def resolve_model(self, tenant_id: str, name: str) -> tuple[_Model, Adapter | None]:
        """The base model a request's ``model`` names (its name or an alias) or whose adapter
        it names; 404 ``model_not_found`` for neither, or another tenant's adapter."""
        model = self._by_name.get(name)
        if model is not None:
            return model, None
        adapter = await self.adapters.resolve(tenant_id, name)
        assert adapter is not None and adapter.base is not None, "a base is in _by_name"
        return self._by_name[adapter.base], adapter

    async def start(self) -> None:
        self.mux.start()
        if self.metrics_server is not None:
            await self.metrics_server.start()
        if self.admin_server is not None:
            await self.admin_server.start()
        self._tasks = [*(asyncio.create_task(d.run(), name=f"dispatcher {d.pool}")
                         for d in self.dispatchers),
                       asyncio.create_task(self._listen_for_wakes(), name="wake listener"),
                       asyncio.create_task(self._publish_metrics(), name="metrics"),
                       asyncio.create_task(self.readers.run(), name="reader leases")]

    async def stop(self) -> None:
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.admin_server is not None:
            await self.admin_server.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for dispatcher in self.dispatchers:
            await dispatcher.shutdown()
        await self.mux.stop()
        await self.client.aclose()

    # ---- the request path ----

    def deployment_limits(self) -> DeploymentLimits:
        """What the OpenAPI document states of this deployment."""
        return DeploymentLimits(self.model.served_model_name, self.api.max_n,
                                self.tokenizer.vocab_size, self.context_tokens)

    @property
    def context_tokens(self) -> int:
        """Longest prompt + output a request of the default model may have."""
        return self.default.context_tokens

    async def authenticate(self, authorization: str | None, for_admission: bool = False
                           ) -> Principal:
        """``for_admission``: a tenant past its rpm, tpm or budget is refused before the
        request is tokenized (``ApiKeys.authenticate``)."""
        scheme, _, credential = (authorization or "").partition(" ")
        api_key = credential.strip() if scheme.lower() == "bearer" else None
        return await self.api_keys.authenticate(api_key, for_admission=for_admission)

    async def authenticate_to_submit(self, authorization: str | None,
                                     request: ChatCompletionRequest | CompletionRequest,
                                     idempotency_key: str | None) -> Principal:
        """As ``authenticate`` before a submission: a tenant past its quotas is refused before
        any work, unless this is a retry of a request it already has (an Idempotency-Key that
        joins it is never refused for the quota its first sending used)."""
        try:
            return await self.authenticate(authorization, for_admission=True)
        except RateLimitError:
            if idempotency_key is None:
                raise
            principal = await self.authenticate(authorization)
            request_id = _request_id(principal.tenant_id, request, idempotency_key)
            if await self.client.exists(keys.request(principal.tenant_id, request_id)):
                return principal
            raise

    async def submit(self, principal: Principal, request: ChatCompletionRequest | CompletionRequest,
                     idempotency_key: str | None) -> Submission:
        model, adapter = await self.resolve_model(principal.tenant_id, request.model)
        if isinstance(request, ChatCompletionRequest):
            check_references(request)
        await check_sampling(request, model.tokenizer.vocab_size, self.api.max_n,
                             model.tokenizer.tool_format)
        prompt_ids, prompt_param = await self._prompt_ids(request, model)
        max_tokens = await self._max_tokens(principal.tenant_id, request, len(prompt_ids),
                                            prompt_param, model.context_tokens)
        wire: dict[str, Any] = {"prompt_token_ids": prompt_ids,
                                "sampling": sampling_wire(request, max_tokens,
                                                          model.tokenizer.tool_format)}
        if adapter is not None:  # the replicas load it by name (and path, if added at run time)
            wire["adapter"] = [adapter.name, adapter.path]
        body = json.dumps(wire)
        request_id = _request_id(principal.tenant_id, request, idempotency_key)
        shape = Shape.of(request, request_id, request.model, len(prompt_ids), model.name)
        # the name the tenant's allow-list is checked against: the model's own, not an alias
        canonical = adapter.name if adapter is not None else model.name
        trace_fields = carrier() if self.tracing.is_on else {}
        meta = encode_meta({**trace_fields, "shape": shape.to_wire()}, now_ns())
        reader = self.readers.new(principal.tenant_id, request_id, ReaderKind.STREAM)
        try:
            admission = await self.queues.admit(AdmitRequest(
                principal.tenant_id, request_id, len(prompt_ids), max_tokens, body, meta,
                num_choices=request.n, reader=reader, reader_lease_end_ms=lease_end_ms(),
                is_idempotent=idempotency_key is not None, model=canonical, pool=model.pool))
        except NotReplicatedError:  # admitted on the primary: its client goes away for now
            self.readers.admitted(reader)  # (a retry with the key joins it within the grace)
            await self.detach(reader)
            raise
        if admission.is_duplicate:  # a retry joins the request: a reader of its own
            await self.readers.attach(reader)
        else:
            self.readers.admitted(reader)
            self.metrics.inc("fairserve_model_requests",
                             (self.metrics.model_label(canonical),))
            model.dispatcher.wake()
            await self.client.publish(keys.wake_channel(), b"1")
        return Submission(principal.tenant_id, request_id, len(prompt_ids), max_tokens,
                          admission.is_duplicate, admission.queue_depth, shape, reader,
                          admission.rate_limit_headers)

    async def _prompt_ids(self, request: ChatCompletionRequest | CompletionRequest,
                          model: _Model) -> tuple[list[int], str]:
        """The prompt's token ids and the field it came in. Text far longer than the context
        could hold is refused before it is tokenized; a long one is tokenized on a worker
        thread (the tokenizer releases the GIL), so one large prompt does not stall every
        other request on this router's event loop."""
        if isinstance(request, ChatCompletionRequest):
            tokenizer = model.tokenizer  # with its tools, if any, as the model takes them
            chat = chat_prompt(request, tokenizer.tool_format, tokenizer.template_takes_tools)
            num_chars = chat.num_chars()
            self._check_prompt_chars(num_chars, "messages", model.context_tokens)
            encode = functools.partial(tokenizer.encode_chat, tools=chat.tools)
            return await self._off_loop(num_chars, encode, chat.messages), "messages"
        prompt = request.prompt
        if isinstance(prompt, str) or all(isinstance(p, str) for p in prompt):
            text = prompt if isinstance(prompt, str) else str(prompt[0])
            self._check_prompt_chars(len(text), "prompt", model.context_tokens)
            ids = await self._off_loop(len(text), model.tokenizer.encode, text)
        else:
            ids = [int(t) for t in prompt]
            vocab = model.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return ids, "prompt"

    @staticmethod
    def _check_prompt_chars(num_chars: int, param: str, context: int) -> None:
        limit = context * MAX_PROMPT_CHARS_PER_TOKEN
        if num_chars > limit:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters: more than this model's context of "
                f"{context} tokens can hold (at most {limit} characters are "
                f"tokenized)", param=param, code=CONTEXT_LENGTH_EXCEEDED)

    @staticmethod
    async def _off_loop(num_chars: int, tokenize: Callable[[T], list[int]], text: T
                        ) -> list[int]:
        if num_chars < TOKENIZE_OFF_LOOP_CHARS:  # a thread hop costs more than a short text
            return tokenize(text)
        return await asyncio.to_thread(tokenize, text)

    async def _max_tokens(self, tenant_id: str, request: ChatCompletionRequest | CompletionRequest,
                          num_prompt: int, prompt_param: str, context: int) -> int:
        if num_prompt >= context:
            raise InvalidRequestError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{num_prompt}", param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
        requested = request.requested_max_tokens
        most = stream_max_tokens(request.n)
        if requested is None:  # chat: as long as the context, the tenant's cap and the stream allow
            cap = await self.client.hget(keys.tenant(tenant_id), "max_tokens")
            requested = min(context - num_prompt, int(cap) if cap else context, most)
        elif requested > most:
            raise InvalidRequestError(
                f"max_tokens {requested} with n {request.n}: one response stream holds at most "
                f"{most} tokens per choice", param="max_tokens")
        elif num_prompt + requested > context:
            raise InvalidRequestError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{num_prompt} and max_tokens is {requested}", param="max_tokens",
                code=CONTEXT_LENGTH_EXCEEDED)
        if request.min_tokens > requested:
            raise InvalidRequestError(
                f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({requested})",
                param="min_tokens", code=MIN_TOKENS_OVER_MAX_TOKENS)
        return requested

    async def events(self, tenant_id: str, request_id: str, point: ReadPoint | None = None
                     ) -> AsyncIterator[tuple[str, response_events.ChunkData |
                                              response_events.EndData]]:
        """(event id, event) of the request's response stream from ``point``, then live: each
        token once (``ReadPoint``), each id the one its client may resume from."""
        async for batch in self.event_batches(tenant_id, request_id, point):
            for item in batch:
                yield item

    async def event_batches(self, tenant_id: str, request_id: str, point: ReadPoint | None = None
                            ) -> AsyncIterator[list[tuple[str, response_events.ChunkData |
                                                          response_events.EndData]]]:
        """As ``events``, each time all that has arrived (``StreamMux.read_batches``)."""
        point = point or ReadPoint()
        async for batch in self.mux.read_batches(tenant_id, request_id, point.after,
                                                 idle_timeout_s=self.api.stream_idle_timeout_s):
            taken = []
            for event in batch:
                item = response_events.parse(event)
                if isinstance(item, response_events.ChunkData) and not point.take(item):
                    continue  # the client has it (made again after a Redis failover)
                taken.append((point.event_id(event.event_id), item))
            yield taken

    async def model_cards(self, tenant_id: str) -> list[dict[str, Any]]:
        """``/v1/models`` for a tenant: the base models (and their aliases) and the LoRA
        adapters it may use, each with its context length; an alias's ``root`` is its model."""
        allowed = await self.allowed_models(tenant_id)
        cards = []
        for model in self.models:
            info, base = model.served.info, model.name
            if allowed is not None and base not in allowed:
                continue  # nor its aliases: the allow-list names models, not their aliases
            cards += [{"id": name, "object": "model", "created": info.created_s,
                       "owned_by": "fairserve", "root": base, "parent": None,
                       "max_model_len": model.context_tokens}
                      for name in (base, *model.served.aliases)]
        for adapter in await self.adapters.visible(tenant_id):
            of = self._by_name.get(adapter.base or self.default.name)
            if of is None or of.name != (adapter.base or self.default.name):
                continue  # of a base model this cluster does not serve
            if allowed is None or adapter.name in allowed:
                cards.append({"id": adapter.name, "object": "model",
                              "created": adapter.created_s or of.served.info.created_s,
                              "owned_by": adapter.owner or "fairserve", "root": of.name,
                              "parent": of.name, "max_model_len": of.context_tokens})
        return cards

    async def chunks_before(self, tenant_id: str, request_id: str, point: ReadPoint
                            ) -> list[response_events.ChunkData]:
        """The token chunks a client resuming from ``point`` has had (each token once): what
        a parser of the answer (tool calls) reads again to stand where the client does."""
        if point.after == START:
            return []
        entries: Any = await self.client.xrange(keys.stream(tenant_id, request_id), "-",
                                                point.after)
        seen, chunks = ReadPoint(), []
        for raw_id, fields in entries:
            item = response_events.parse(StreamEvent(raw_id.decode(), fields[b"type"].decode(),
                                                     fields[b"data"].decode()))
            if isinstance(item, response_events.ChunkData) and seen.take(item):
                chunks.append(item)
        return chunks

    async def allowed_models(self, tenant_id: str) -> set[str] | None:
        """The tenant's allow-list of models (``Tenant.models``); None: every model."""
        raw = cast(bytes | None, await self.client.hget(keys.tenant(tenant_id), "models"))
        return None if raw is None else {m for m in raw.decode().split(",") if m}

    async def shape_of(self, tenant_id: str, request_id: str) -> Shape:
        """What the responses of a request of this tenant look like; 404 for another's."""
        meta = cast(bytes | None, await self.client.hget(keys.request(tenant_id, request_id),
                                                         "meta"))
        fields = decode_meta(meta.decode()) if meta is not None else {}
        if "shape" not in fields:
            raise NotFoundError(f"no request {request_id!r}", param="request_id")
        return Shape.from_wire(fields["shape"])

    async def position(self, tenant_id: str, request_id: str, event_id: str,
                       param: str) -> ReadPoint:
        """Where a client's "last event seen" resumes, checked: an id of this stream's form,
        not past its last event (a future id would skip what comes). An id with positions
        whose event the stream no longer has (a Redis failover lost it) resumes from the
        start, skipping what the client has."""
        if not EVENT_ID.match(event_id):
            raise InvalidRequestError(f"{param}: {event_id!r} is not an event id "
                                      "(<milliseconds>-<sequence>[;<position>,...])",
                                      param=param)
        point = ReadPoint.parse(event_id)
        if max(_id_order(point.after)) >= 2 ** 64:  # past any id Redis can give (64 bits)
            raise InvalidRequestError(f"{param}: {event_id!r} is past the stream's last event",
                                      param=param, code=PAST_THE_STREAM)
        stream_key = keys.stream(tenant_id, request_id)
        if point.has_positions:
            if not await self.client.xrange(stream_key, point.after, point.after, count=1):
                point.after = START
            return point
        last: Any = await self.client.xrevrange(stream_key, count=1)
        newest = last[0][0].decode() if last else START
        if _id_order(point.after) > _id_order(newest):
            raise InvalidRequestError(f"{param}: {event_id!r} is past the stream's last event "
                                      f"{newest!r}", param=param, code=PAST_THE_STREAM)
        return point

    async def attach(self, tenant_id: str, request_id: str, kind: ReaderKind) -> Reader:
        """A client reads the request (429 beyond its tenant's limit of this kind)."""
        reader = self.readers.new(tenant_id, request_id, kind)
        await self.readers.attach(reader)
        return reader

    async def detach(self, reader: Reader) -> None:
        """The client went away, or its answer ended: a request still to run goes on for the
        grace period, then is cancelled unless a client resumes it."""
        try:
            await self.readers.detach(reader)
        except (RouterError, RedisError) as exc:  # its lease runs out and is swept instead
            logger.warning("detaching %s failed: %s", reader.request_id, exc)

    async def cancel(self, tenant_id: str, request_id: str, reason: str = "client") -> None:
        """The client went away: a queued request leaves its queue, a running one is aborted."""
        try:
            outcome = await self.queues.cancel(tenant_id, request_id, reason)
        except (NotFoundError, RedisError) as exc:
            logger.warning("cancelling %s failed: %s", request_id, exc)
            return
        if outcome is CancelOutcome.FLAGGED:
            for dispatcher in self.dispatchers:
                dispatcher.abort_local(request_id)

    # ---- readiness ----

    async def readiness(self) -> dict[str, Any]:
        try:
            await self.client.ping()
        except RedisError as exc:
            return {"ready": False, "redis": f"unreachable: {exc}", "replicas": None}
        loads = await self.capacity.loads()
        ready = bool(loads) or self.api.allow_scale_from_zero
        return {"ready": ready, "redis": "ok", "replicas": len(loads),
                "slots": sum(load.max_ongoing for load in loads)}

    # ---- metrics ----

    async def metrics_exposition(self) -> bytes:
        """``/metrics`` (``MetricsServer``): every live router's counts added up, and the
        cluster's state."""
        members = cast(set[bytes], await self.client.smembers(keys.metrics_routers()))
        routers = [h for h in (m.decode() for m in members) if h != self.holder]
        snapshots = await self.client.mget([keys.router_metrics(h) for h in routers]) \
            if routers else []
        gone = [h for h, raw in zip(routers, snapshots, strict=True) if raw is None]
        if gone:
            await self.client.srem(keys.metrics_routers(), *gone)
        merged = self.metrics.merged([raw for raw in snapshots if raw is not None])
        memory = cast(dict[str, Any], await self.client.info("memory"))
        state = ClusterState(await self.queues.backlog(), await self.capacity.loads(),
                             *await autoscaler_state(self.client),
                             redis_memory=(int(memory["used_memory"]),
                                           int(memory.get("maxmemory", 0))),
                             nodes=await nodes.read(self.client))
        return exposition(merged, state)

    async def _publish_metrics(self) -> None:
        while True:
            try:
                await self.client.set(keys.router_metrics(self.holder), self.metrics.to_json(),
                                      ex=SNAPSHOT_TTL_S)
                await self.client.sadd(keys.metrics_routers(), self.holder)
            except (RedisError, OSError) as exc:
                logger.warning("publishing metrics failed: %s", exc)
            await asyncio.sleep(SNAPSHOT_S)

    async def _listen_for_wakes(self) -> None:
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.wake_channel())
                while True:  # short reads: the client's socket timeout must not fire
                    if await pubsub.get_message(timeout=WAKE_READ_S) is not None:
                        for dispatcher in self.dispatchers:
                            dispatcher.wake()
            except (RedisError, OSError) as exc:
                logger.warning("wake channel lost: %s; polling until it is back", exc)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()


def _request_id(tenant_id: str, request: ChatCompletionRequest | CompletionRequest,
                idempotency_key: str | None) -> str:
    prefix = "chatcmpl" if isinstance(request, ChatCompletionRequest) else "cmpl"
    if idempotency_key is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not 0 < len(idempotency_key) <= IDEMPOTENCY_KEY_MAX_CHARS:
        raise InvalidRequestError(
            f"Idempotency-Key must be 1-{IDEMPOTENCY_KEY_MAX_CHARS} characters",
            param="Idempotency-Key")
    digest = hashlib.sha256(f"{tenant_id}\0{idempotency_key}".encode()).hexdigest()[:32]
    return f"{prefix}-idem-{digest}"
