"""vLLM ``RequestOutput`` (delta mode) -> fairserve ``Chunk``: tokens, text, logprobs, the
finish reason, and on the final chunk the usage and timings.

Nothing here imports vLLM: the functions read the documented attributes of vLLM's records
(``RequestOutput``, ``CompletionOutput``, ``Logprob``, ``RequestStateStats``), described by the
protocols below, so they are tested without it.

NOTE: timings. vLLM stamps a request's arrival in its front end with ``time.time()``, but its
engine core stamps the queued, scheduled, first-token and last-token events with
``time.monotonic()`` (``RequestStateStats``; CLOCK_MONOTONIC is one clock for every process of
a Linux host). fairserve's ``Timings`` are wall-clock instants, so each monotonic stamp is
moved onto the wall clock with one reading of both clocks (``ClockReading``), taken when the
output is handled. The offset between the clocks drifts only when the wall clock is stepped or
slewed; the instants are then clamped so ``arrived <= first_scheduled <= first_token <=
finished`` still holds. ``arrived_s`` is fairserve's arrival (the replica's, which precedes
vLLM's own). vLLM versions that attach no stats to ``RequestOutput.metrics`` (0.10) leave
``first_scheduled_s`` None and ``first_token_s`` the instant the first token was seen here.
vLLM does not report how many chunks a prefill took: ``num_prefill_chunks`` is the least it
could have been, ceil(uncached prompt tokens / max_num_batched_tokens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from replicas.engine.errors import EngineError
from replicas.engine.interface import Chunk, FinishReason, Timings, TokenLogprob, Usage

# vLLM's finish reason strings (vllm.v1.engine.FinishReason); "error" raises instead
_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    # newer vLLM (0.34) ends a request whose output repeats itself (only when asked to, which
    # fairserve never does); a natural end, not a length cut
    "repetition": FinishReason.STOP,
}


class LogprobLike(Protocol):
    """``vllm.logprobs.Logprob``."""

    @property
    def logprob(self) -> float: ...

    @property
    def rank(self) -> int | None: ...


class CompletionOutputLike(Protocol):
    """``vllm.outputs.CompletionOutput`` in delta mode: what this output adds."""

    @property
    def index(self) -> int: ...

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, LogprobLike]] | None: ...

    @property
    def finish_reason(self) -> str | None: ...


class RequestOutputLike(Protocol):
    """``vllm.outputs.RequestOutput``. ``metrics`` is a ``RequestStateStats`` or None; it is
    read by attribute name because its fields differ between vLLM versions."""

    @property
    def outputs(self) -> Sequence[CompletionOutputLike]: ...

    @property
    def num_cached_tokens(self) -> int | None: ...

    @property
    def metrics(self) -> object | None: ...


@dataclass(frozen=True, slots=True)
class ClockReading:
    """The wall and monotonic clocks read at (nearly) the same instant."""

    wall_s: float
    monotonic_s: float

    @classmethod
    def now(cls) -> ClockReading:
        return cls(time.time(), time.monotonic())

    def to_wall(self, monotonic_s: float) -> float:
        return self.wall_s - (self.monotonic_s - monotonic_s)


@dataclass(slots=True)
class ChoiceStream:
    """One choice of a fairserve request, run as one vLLM request: what it has produced so far.

    ``num_prompt_tokens`` is the client's prompt; ``num_engine_prompt_tokens`` what vLLM
    prefills (the prompt plus a migrated choice's ``num_resumed_tokens`` output tokens).
    ``pending_text`` is text of the resumed tokens its client has not had yet; it leads the
    first chunk. ``num_top_logprobs`` is None when logprobs are off.
    """

    request_id: str
    index: int
    num_prompt_tokens: int
    num_engine_prompt_tokens: int
    arrived_s: float
    max_num_batched_tokens: int
    num_top_logprobs: int | None = None
    num_resumed_tokens: int = 0
    pending_text: str = ""
    num_new_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_s: float | None = None  # when the first token was seen here
    metrics: object | None = None  # the latest RequestStateStats vLLM attached
    is_finished: bool = False

    def on_completion(self, completion: CompletionOutputLike, num_cached_tokens: int | None,
                      metrics: object | None, now: ClockReading) -> Chunk | None:
        """The chunk for one delta; None when it adds nothing (no token, no text, no end)."""
        assert not self.is_finished, f"{self.request_id}/{self.index}: output after the end"
        reason = finish_reason(completion.finish_reason)
        token_ids = tuple(completion.token_ids)
        if num_cached_tokens is not None:
            self.num_cached_tokens = num_cached_tokens
        if metrics is not None:
            self.metrics = metrics
        if token_ids and self.first_token_s is None:
            self.first_token_s = now.wall_s
        self.num_new_tokens += len(token_ids)
        text = self.pending_text + completion.text
        self.pending_text = ""
        if not token_ids and not text and reason is None:
            return None
        logprobs = None
        if self.num_top_logprobs is not None:
            logprobs = token_logprobs(token_ids, completion.logprobs, self.num_top_logprobs)
        if reason is None:
            return Chunk(self.request_id, token_ids, text, logprobs=logprobs, index=self.index)
        return self._final(token_ids, text, reason, logprobs, now)

    def end_chunk(self, reason: FinishReason, now: ClockReading) -> Chunk:
        """A final chunk made here: ABORT when the request is stopped, LENGTH when a migrated
        choice has no tokens left to make. Text still pending goes with it."""
        text, self.pending_text = self.pending_text, ""
        return self._final((), text, reason, None, now)

    def usage(self) -> Usage:
        # a resumed choice's own output tokens sit in vLLM's prompt: cached, but not prompt
        return Usage(
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=min(self.num_cached_tokens, self.num_prompt_tokens),
            num_output_tokens=self.num_resumed_tokens + self.num_new_tokens,
        )

    def timings(self, now: ClockReading) -> Timings:
        scheduled = _stamp(self.metrics, "scheduled_ts", now)
        first_token = _stamp(self.metrics, "first_token_ts", now) or self.first_token_s
        arrived = self.arrived_s
        if scheduled is not None:
            scheduled = max(scheduled, arrived)
        if first_token is not None:
            first_token = max(first_token, scheduled if scheduled is not None else arrived)
        finished = max(now.wall_s, first_token if first_token is not None else arrived)
        return Timings(
            arrived_s=arrived,
            first_scheduled_s=scheduled,
            first_token_s=first_token,
            finished_s=finished,
            num_prefill_chunks=self._num_prefill_chunks(first_token is not None),
            num_preemptions=int(getattr(self.metrics, "num_preemptions", 0) or 0),
        )

    def _num_prefill_chunks(self, is_prefilled: bool) -> int:
        if not is_prefilled:
            return 0
        uncached = max(1, self.num_engine_prompt_tokens - self.num_cached_tokens)
        return math.ceil(uncached / self.max_num_batched_tokens)

    def _final(self, token_ids: tuple[int, ...], text: str, reason: FinishReason,
               logprobs: tuple[TokenLogprob, ...] | None, now: ClockReading) -> Chunk:
        self.is_finished = True
        return Chunk(self.request_id, token_ids, text, finish_reason=reason, logprobs=logprobs,
                     usage=self.usage(), timings=self.timings(now), index=self.index)


def chunks_from_output(output: RequestOutputLike, streams: Mapping[int, ChoiceStream],
                       now: ClockReading) -> list[Chunk]:
    """The chunks of one vLLM output; ``streams`` maps vLLM's completion index to the choice
    it is (the engine runs each choice as its own vLLM request: ``{0: choice}``)."""
    chunks = []
    for completion in output.outputs:
        stream = streams.get(completion.index)
        if stream is None:
            raise EngineError(f"vLLM returned completion {completion.index}, which no choice is")
        chunk = stream.on_completion(completion, output.num_cached_tokens, output.metrics, now)
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def finish_reason(reason: str | None) -> FinishReason | None:
    """vLLM's finish reason string -> fairserve's; vLLM's "error" (a failed KV load, say)
    raises ``EngineError``: a stream raises, it does not end normally."""
    if reason is None:
        return None
    mapped = _FINISH_REASONS.get(reason)
    if mapped is None:
        detail = "an internal error" if reason == "error" else f"the unknown reason {reason!r}"
        raise EngineError(f"vLLM ended the request with {detail}")
    return mapped


def token_logprobs(token_ids: Sequence[int],
                   positions: Sequence[Mapping[int, LogprobLike]] | None,
                   num_top: int) -> tuple[TokenLogprob, ...]:
    """One ``TokenLogprob`` per sampled token.

    vLLM gives, per position, a dict of token id -> Logprob holding the ``num_top`` most likely
    tokens (ranks 1..num_top) and the sampled token (whatever its rank). ``top`` keeps the
    ranked alternatives, most likely first.
    """
    if not token_ids:
        return ()
    if positions is None or len(positions) != len(token_ids):
        got = None if positions is None else len(positions)
        raise EngineError(f"vLLM returned logprobs for {got} of {len(token_ids)} tokens")
    result = []
    for token_id, position in zip(token_ids, positions, strict=True):
        sampled = position.get(token_id)
        if sampled is None:
            raise EngineError(f"vLLM's logprobs lack the sampled token {token_id}")
        ranked = sorted((entry.rank, tid, entry.logprob) for tid, entry in position.items()
                        if entry.rank is not None and entry.rank <= num_top)
        top = tuple((tid, logprob) for _, tid, logprob in ranked[:num_top])
        result.append(TokenLogprob(token_id, sampled.logprob, top))
    return tuple(result)


def _stamp(metrics: object | None, name: str, now: ClockReading) -> float | None:
    """A monotonic engine-core stamp of ``RequestStateStats`` on the wall clock; 0 is unset."""
    value = getattr(metrics, name, 0.0) if metrics is not None else 0.0
    return now.to_wall(float(value)) if value else None
