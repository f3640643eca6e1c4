"""The replica call: one request sent to a model replica (``ReplicaCall``) with how to sample
it, whose tokens they are, where its output goes and where a migrated request stands. A typed
struct built once by the router and read by attribute by the replica; Ray pickles it, once per
request. Tokens do not come back here: the replica appends them to the request's response
stream in Redis (``CallStream``, through the router's stream writer it is given:
``replicas/protocol/services.py``), and the router's readers take them from there
(``router/dispatch/stream_mux.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Self


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
    # replicas an earlier attempt of this request left (stalled, unreachable): the request
    # router passes over them while another can take the call (``PrefixAffinityRouter``)
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CallAdapter:
    """The LoRA adapter a call generates with: its name, and its PEFT directory when it was
    added at run time (``fairserve adapters add``; None: one the replica's settings name)."""

    name: str
    path: str | None = None
