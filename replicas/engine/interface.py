"""The contract between a replica and its engine (torch engine or vLLM adapter).

A replica knows nothing of tenants or queues: it hands the engine a ``GenerateRequest`` and
relays the ``Chunk`` objects that ``generate`` yields. Every engine passes one contract test
suite (``tests/replicas/engine/test_contract.py``).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from replicas.engine.sampling_params import SamplingParams
from replicas.protocol import ChunkTimings as Timings  # the router reads them as they are

__all__ = ["CachedPrefix", "ChoiceResume", "Chunk", "Engine", "FinishReason", "GenerateRequest",
           "LoadSnapshot", "SchedulingHints", "TokenLogprob", "Timings", "Usage"]


class FinishReason(enum.StrEnum):
    """Why a request stopped; the values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"  # a stop string, a stop token or EOS
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"  # abort(request_id), or the engine shut down


@dataclass(frozen=True, slots=True)
class ChoiceResume:
    """Where a choice of a migrated request stands: the output tokens its client has had (they
    are output, not prompt: max_tokens, min_tokens, penalties, seeded positions and the grammar
    count them), how many characters of their text were sent (the rest, held back for a stop
    string or a multi-byte character, is sent by the resumed run), and whether it had ended."""

    index: int
    token_ids: tuple[int, ...] = ()
    num_text_chars_sent: int = 0
    is_finished: bool = False


@dataclass(frozen=True, slots=True)
class SchedulingHints:
    """Who a request is for, as the engine's fair scheduler sees it: an opaque fairness key
    (the router passes the tenant), a priority class (higher first) and a weight (> 0)."""

    key: str
    priority: int = 0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"scheduling weight must be positive, got {self.weight}")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation request.

    Exactly one of ``prompt_token_ids``, ``prompt`` (raw text) or ``messages`` (chat, rendered
    with the model's chat template and a generation prompt) must be given. ``resume``: a
    request that ran elsewhere first (a migration), continued from where each choice stands;
    it streams only what follows, and its final usage counts every output token once.
    """

    request_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    arrival_time_s: float | None = None  # wall clock (time.time()); defaults to now
    resume: tuple[ChoiceResume, ...] = ()
    scheduling: SchedulingHints | None = None  # None: the engine's shared default key
    # the prefix-cache partition (vLLM's cache_salt): requests share cached blocks only with
    # requests of the same salt (``replicas.protocol.cache_root``); None: the shared one
    cache_salt: str | None = None
    # a LoRA adapter of the model (EngineConfig.lora_adapters) to generate with; None: the base
    adapter: str | None = None
    # the adapter's PEFT directory, for one added at run time (the engine learns it by name)
    adapter_path: str | None = None

    @property
    def num_open_choices(self) -> int:
        """Choices still to run (each ends with one final chunk)."""
        return self.sampling.n - sum(r.is_finished for r in self.resume)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one sampled token and, if asked, its top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one engine step produced for one request.

    ``token_ids`` are the new tokens; ``text`` is the new text (it may lag the tokens while a
    stop string or a multi-byte character could still be forming). The final chunk has
    ``finish_reason``, ``usage`` and ``timings`` set. A request with ``n`` choices streams the
    chunks of all of them, each with its ``index``; it ends after ``n`` final chunks, one per
    choice, each with that choice's usage (its prompt tokens, its cached prompt tokens, its
    output tokens) and timings.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    index: int = 0  # the choice, for a request with n > 1

    @property
    def is_final(self) -> bool:
        """The last chunk of this choice."""
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What an engine reports for dispatch and autoscaling."""

    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_slots: int  # how many more requests it would start now (max_num_seqs - running - waiting)
    num_steps: int = 0  # steps taken since start
    # steps, plus the model layers run within them where the engine counts those (the torch
    # engine does): a stuck engine stops counting, a long step keeps counting
    progress: int = 0
    compute: str = ""  # what it runs: "torch cpu bfloat16", "vllm cuda:0 bfloat16", ...
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds loaded


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The chained hashes of cached full blocks (``replicas/torch_engine/block_manager.py``), the
    most recently cached first, and a version that changes whenever they do."""

    version: int = 0
    block_hashes: tuple[int, ...] = ()


@runtime_checkable
class Engine(Protocol):
    """A batched prefill/decode engine behind one replica."""

    async def start(self) -> None:
        """Load the model and start the step loop; returns once requests can be accepted."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Yield chunks as they are produced; the last one is final.

        Raises ``InvalidRequestError`` before anything is scheduled when the request is bad.
        """

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; True if it was running or waiting."""

    def cached_prefix(self) -> CachedPrefix:
        """What the prefix cache holds, for prefix-aware routing (replicas publish it);
        ``CachedPrefix()`` (empty) where the engine does not tell."""
        ...

    def load(self) -> LoadSnapshot:
        """A snapshot of the engine's load."""

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the step loop is dead or stuck."""

    async def shutdown(self) -> None:
        """Abort everything, stop the loop and release the model."""
