"""What the router and the model replicas both know: the one package each side imports from the
other, light enough for a router process (no torch, no engine, nothing of ``router`` or of the
rest of ``replicas``; ``tests/test_layering.py`` holds both sides to it).

- ``limits``: the sampling limits both sides check.
- ``prefix``: block hashing of prompts (the engine's prefix cache and the router's
  prefix-affinity routing hash alike) and the keys of a replica's routing stats.
- ``call``: the replica call (``ReplicaCall``), pickled by Ray once a request.
- ``report``: what a replica reports back about a call (``CallReport``), with its one codec.
- ``grammar``: the grammars of ``response_format``; the router checks, the replica enforces.
- ``load``: a replica's load report (``ReplicaLoad``).
- ``model_info``: what the router knows of a served model (``ModelInfo``).
- ``trace_context``: the W3C trace context a call carries.
- ``services``: the router's code a replica runs, as Protocols it is handed by injection
  (``ReplicaServices``).
"""

from replicas.protocol.call import (
    CallAdapter,
    CallResume,
    CallSampling,
    CallScheduling,
    CallStream,
    GuideKind,
    ReplicaCall,
    StructuredOutput,
)
from replicas.protocol.grammar import (
    MAX_FORCED_CALLS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    GrammarError,
    check_grammar,
    grammar_for,
)
from replicas.protocol.limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_PRESENCE_FREQUENCY_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
)
from replicas.protocol.load import ReplicaLoad
from replicas.protocol.model_info import ModelInfo
from replicas.protocol.prefix import (
    PUBLISHED_ADAPTERS,
    PUBLISHED_BLOCKS,
    PUBLISHED_VERSION,
    ROOT_HASH,
    adapter_salt,
    cache_root,
    hash_block_tokens,
)
from replicas.protocol.report import CallReport, ChunkTimings, ChunkUsage, Halt
from replicas.protocol.services import (
    LoadPublisher,
    LoadPublisherFactory,
    LogprobWire,
    ReplicaServices,
    ReplicaTracing,
    StreamSink,
    StreamSinkFactory,
    TracingSetup,
)
from replicas.protocol.trace_context import carrier, context_of

__all__ = [
    "MAX_FORCED_CALLS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_N",
    "MAX_PRESENCE_FREQUENCY_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_TEMPERATURE",
    "MAX_TOP_LOGPROBS",
    "PUBLISHED_ADAPTERS",
    "PUBLISHED_BLOCKS",
    "PUBLISHED_VERSION",
    "ROOT_HASH",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "CallAdapter",
    "CallReport",
    "CallResume",
    "CallSampling",
    "CallScheduling",
    "CallStream",
    "ChunkTimings",
    "ChunkUsage",
    "GrammarError",
    "GuideKind",
    "Halt",
    "LoadPublisher",
    "LoadPublisherFactory",
    "LogprobWire",
    "ModelInfo",
    "ReplicaCall",
    "ReplicaLoad",
    "ReplicaServices",
    "ReplicaTracing",
    "StreamSink",
    "StreamSinkFactory",
    "StructuredOutput",
    "TracingSetup",
    "adapter_salt",
    "cache_root",
    "carrier",
    "check_grammar",
    "context_of",
    "grammar_for",
    "hash_block_tokens",
]
