"""The sampling limits both sides check: the router refuses a request the engine would refuse,
with OpenAI's 400, before it is queued; the engine checks a call again
(``replicas/engine/sampling_params.py``). Names and ranges are vLLM's and OpenAI's."""

from __future__ import annotations

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
