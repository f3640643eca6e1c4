"""What the router and the model replicas both know: the one module each side imports from the
other, light enough for a router process (no torch, no engine).

- The sampling limits both sides check (the router refuses a request the engine would refuse,
  with OpenAI's 400, before it is queued).
- Block hashing of prompts (``hash_block_tokens``): the engine's prefix cache registers full
  KV blocks under these hashes, and the router's prefix-affinity routing hashes a prompt the
  same way to find the replica that holds it (``router/dispatch/prefix_affinity.py``).
- The keys of a replica's routing stats that carry its cached block hashes.
- The replica call and the reports it streams back (``ReplicaCall``, ``CallReport``): typed
  structs, built once by their sender and read by attribute by their receiver. A call goes
  as it is (Ray pickles it, once per request); a report crosses as the plain sequence of its
  one codec (``CallReport.encode``/``decode``), which Ray packs without pickling. Tokens do
  not cross here: the replica appends them to the request's response stream in Redis
  (``CallStream``), one script call per engine step for all the calls it runs, and the
  router's readers take them from there (``router/dispatch/stream_mux.py``).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

# ---- sampling limits (names and ranges are vLLM's and OpenAI's) ----
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512  # each stop string is matched against the text at every step
MAX_SCHEMA_BYTES = 32 * 1024  # a response_format's JSON Schema, serialized (compiled per request)
MAX_SCHEMA_DEPTH = 32  # nesting of its objects and arrays
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0
MAX_PRESENCE_FREQUENCY_PENALTY = 2.0
MAX_REPETITION_PENALTY = 1e9
MAX_N = 128  # OpenAI's limit; a deployment sets its own below it (router.api.max_n)

# ---- prefix blocks ----
# Stands in for the parent hash of a sequence's first block.
ROOT_HASH = 0x5EED_F00D_CAFE_BEEF


def cache_root(salt: str | None) -> int | None:
    """The parent hash of a sequence's first block in the prefix-cache partition ``salt``
    (vLLM's ``cache_salt``): sequences share cached blocks only within one partition, so one
    tenant cannot learn from ``cached_tokens`` what another sent. None: the shared partition.
    A digest of the salt, not ``hash()`` of it: a string's hash differs per process."""
    if not salt:
        return None
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return hash((ROOT_HASH, int.from_bytes(digest, "big")))


def adapter_salt(salt: str | None, adapter: str | None) -> str | None:
    """The prefix-cache partition of a request: its salt, and its LoRA adapter (an adapter's
    KV differs from the base model's); the engine and the replica choice key blocks alike."""
    if adapter is None:
        return salt
    return f"{salt or ''}\x00lora:{adapter}"


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block: the same in every process (a tuple of ints hashes
    without Python's per-process string salt), so a router and a replica agree."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, token_ids))


# the keys of a replica's routing stats (replicas/server.py, ModelReplica.record_routing_stats)
PUBLISHED_BLOCKS = "cached_block_hashes"
PUBLISHED_VERSION = "cached_version"
PUBLISHED_ADAPTERS = "loaded_adapters"  # the LoRA adapters a replica holds loaded


# ---- the replica call (pickled by Ray, once a request) and its reports (``encode``d) ----
@dataclass(frozen=True, slots=True)
class CallResume:
    """Where a choice of a migrated request stands (``replicas.engine.interface.ChoiceResume``):
    the output tokens its client has had and how many characters of their text went out."""

    index: int
    token_ids: tuple[int, ...]
    num_text_chars_sent: int
    is_finished: bool


@dataclass(frozen=True, slots=True)
class CallScheduling:
    """Whose tokens these are, for the engine's fair scheduler: the tenant, its priority class
    and its weight (``replicas.engine.interface.SchedulingHints``)."""

    key: str
    priority: int = 0
    weight: float = 1.0


class GuideKind(enum.StrEnum):
    """What a structured output is constrained to (OpenAI's ``response_format`` types)."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON valid under ``StructuredOutput.schema``
    TOOL_CALLS = "tool_calls"  # a forced tool call: <tool_call>[calls under the schema]</tool_call>
    TOOL_CALL_BLOCKS = "tool_call_blocks"  # the same in Hermes' blocks: one call object each


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow; ``schema`` is the JSON Schema as JSON text."""

    kind: GuideKind
    schema: str = ""


@dataclass(frozen=True, slots=True)
class CallSampling:
    """How to sample a call's output: the fields and defaults of the engine's
    ``SamplingParams``, which is this struct with its checks
    (``replicas/engine/sampling_params.py``: the replica checks a call again there). The
    router stores them with the request as JSON, only the fields that differ from these
    defaults (``router.api.sampling.sampling_wire``), and reads them back with ``from_wire``."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Self:
        """From the stored JSON; a field this struct does not have is a ``TypeError``."""
        args = dict(wire)
        for name in ("stop", "stop_token_ids"):
            if name in args:
                args[name] = tuple(args[name])
        if "logit_bias" in args:
            args["logit_bias"] = tuple((int(t), float(b)) for t, b in args["logit_bias"])
        form = args.get("structured_output")
        if form is not None:
            args["structured_output"] = StructuredOutput(GuideKind(form["kind"]),
                                                         form.get("schema", ""))
        return cls(**args)


@dataclass(frozen=True, slots=True)
class CallStream:
    """Where a call's output goes: its request's response stream in Redis, which the replica
    appends to itself, once per engine step for all its calls (``router/state/scripts/
    append.lua``). Fenced twice: by the dispatcher's lease (tenant, request, holder, attempt)
    and by ``writer``, the one call the lease holder lets write (a call it gave up on cannot)."""

    tenant_id: str
    request_id: str
    holder: str
    attempt: int
    writer: str


@dataclass(frozen=True, slots=True)
class ReplicaCall:
    """One request sent to a model replica; ``trace`` is the W3C trace context of the dispatch
    span."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: CallSampling
    stream: CallStream
    scheduling: CallScheduling | None = None
    cache_salt: str | None = None  # the prefix-cache partition (``cache_root``)
    resume: tuple[CallResume, ...] = ()
    trace: dict[str, str] | None = None
    adapter: CallAdapter | None = None  # a LoRA adapter of the model; None: the base model


@dataclass(frozen=True, slots=True)
class CallAdapter:
    """The LoRA adapter a call generates with: its name, and its PEFT directory when it was
    added at run time (``fairserve adapters add``; None: one the replica's settings name)."""

    name: str
    path: str | None = None


@dataclass(frozen=True, slots=True)
class ChunkUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ChunkTimings:
    """Wall-clock instants (``time.time()`` seconds) of a request's life in the engine (the
    engine's ``Timings``: one type on both sides).

    engine queue = first_scheduled - arrived; prefill = first_token - first_scheduled;
    decode = finished - first_token.
    """

    arrived_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    num_prefill_chunks: int = 0
    num_preemptions: int = 0


class Halt:
    """Why a replica stopped a call before its end (``CallReport.halted``)."""

    CANCELLED = "cancelled"  # the request's cancel flag was up (its client went away)
    LEASE_LOST = "lease_lost"  # the stream refused its writes: another holder or writer
    REDIS_UNAVAILABLE = "redis_unavailable"  # no write went through for the outage allowance
    STREAM_GAP = "stream_gap"  # the stream lost chunks this call's follow (a Redis failover)


@dataclass(frozen=True, slots=True)
class CallReport:
    """What a replica tells the dispatcher over Ray about a call; the tokens themselves go to
    the response stream (``CallStream``). The first report of every call names the replica
    (who has the request); while it runs, an empty report now and then says the call is alive
    (all fields empty); each choice's end comes once its last chunk is in the stream, with the
    choice's output tokens there (``position``), its ``usage`` and ``timings``; ``halted`` says
    the replica stopped the call early and why (``Halt``)."""

    replica_id: str | None = None
    index: int = 0
    finish_reason: str | None = None
    position: int = 0
    usage: ChunkUsage | None = None
    timings: ChunkTimings | None = None
    halted: str | None = None

    # NOTE: the codec. Ray packs plain lists, strings and numbers with msgpack and pickles any
    # other object (a slotted dataclass per message cost the replica 0.07 ms each, measured
    # when a message went per token), so a report crosses as the plain sequence of its fields
    # in this order, and nowhere else.
    def encode(self) -> tuple[Any, ...]:
        usage, timings = self.usage, self.timings
        return (self.replica_id, self.index, self.finish_reason, self.position,
                None if usage is None else (usage.prompt_tokens, usage.completion_tokens,
                                            usage.cached_tokens),
                None if timings is None else (
                    timings.arrived_s, timings.first_scheduled_s, timings.first_token_s,
                    timings.finished_s, timings.num_prefill_chunks, timings.num_preemptions),
                self.halted)

    @classmethod
    def decode(cls, wire: Sequence[Any]) -> CallReport:
        replica_id, index, finish, position, usage, timings, halted = wire
        return cls(replica_id, int(index), finish, int(position),
                   None if usage is None else ChunkUsage(*usage),
                   None if timings is None else ChunkTimings(*timings), halted)
