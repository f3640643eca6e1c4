"""Per-sequence output: text deltas, stop strings, stop tokens, grammars, and the final chunk.

NOTE: a stop string can span several tokens, so text that could be the start of a stop string
is held back until it either completes one (the request finishes, the stop string and what
follows are dropped, as OpenAI does; with ``include_stop_str_in_output`` the stop string is
kept) or stops matching (the text is released). Stop tokens and EOS end the request and add no
text. A structured-output grammar that is complete ends it too. Tokens are reported as they
are sampled; only text lags. A choice of an ``n > 1`` request reports under its request's id
with its ``index``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from replicas.engine.interface import Chunk, FinishReason, Timings, TokenLogprob, Usage
from replicas.engine.tokenizer import IncrementalDetokenizer
from replicas.torch_engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    request_id: str  # the request's id (the sequence's, or its parent's for a choice of n)
    index: int = 0  # which choice
    num_text_sent: int = 0  # characters of detokenizer text already sent
    _text: str = field(default="")

    def resume(self, token_ids: tuple[int, ...], num_text_chars_sent: int) -> None:
        """Continue a migrated choice: its output so far, of which the client has the first
        ``num_text_chars_sent`` characters of text (the rest is sent from here)."""
        for token_id in token_ids:
            self.seq.append_token(token_id)
            if self.seq.guide is not None:
                self.seq.guide.accept(token_id)
        self.detokenizer.add(list(token_ids))
        self._text = self.detokenizer.text
        self.num_text_sent = min(num_text_chars_sent, len(self._text))

    def on_token(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Account for one sampled token (already appended to seq); returns why it finished."""
        params = self.seq.sampling
        guide = self.seq.guide
        if guide is not None and not guide.accept(token_id):
            logger.warning("%s: the grammar refused token %d; ending the output there",
                           self.seq.request_id, token_id)
            return self._flush(FinishReason.STOP)
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        ):
            return self._flush(FinishReason.STOP)
        self.detokenizer.add([token_id])
        self._text = self.detokenizer.text
        if params.stop and self._truncate_at_stop():
            return FinishReason.STOP
        if guide is not None and guide.is_finished:  # the JSON is complete
            return self._flush(FinishReason.STOP)
        if self.seq.num_output_tokens >= params.max_tokens or self.seq.num_tokens >= max_model_len:
            return self._flush(FinishReason.LENGTH)
        return None

    def _flush(self, reason: FinishReason) -> FinishReason:
        """Release text held back for an unfinished multi-byte character."""
        if self.detokenizer.flush():
            self._text = self.detokenizer.text
            if self.seq.sampling.stop:
                self._truncate_at_stop()
        return reason

    def chunk(
        self,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...] | None,
        finish: FinishReason | None,
    ) -> Chunk:
        end = len(self._text) if finish is not None else len(self._text) - self._held_back()
        end = max(end, self.num_text_sent)
        delta = self._text[self.num_text_sent : end]
        self.num_text_sent = end
        if finish is None:
            return Chunk(self.request_id, token_ids, delta, logprobs=logprobs, index=self.index)
        return Chunk(
            self.request_id,
            token_ids,
            delta,
            finish_reason=finish,
            logprobs=logprobs,
            usage=usage_of(self.seq),
            timings=timings_of(self.seq),
            index=self.index,
        )

    def _truncate_at_stop(self) -> bool:
        # Only text not yet sent can hold a new match (sent text was checked already).
        longest = max(len(s) for s in self.seq.sampling.stop)
        search_from = max(0, self.num_text_sent - longest + 1)
        hits = [(i, len(s)) for s in self.seq.sampling.stop
                if (i := self._text.find(s, search_from)) >= 0]
        if not hits:
            return False
        start, length = min(hits)
        kept = start + length if self.seq.sampling.include_stop_str_in_output else start
        self._text = self._text[:kept]
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        unsent = self._text[self.num_text_sent :]
        best = 0
        for stop in self.seq.sampling.stop:
            for n in range(min(len(stop) - 1, len(unsent)), best, -1):
                if unsent.endswith(stop[:n]):
                    best = n
                    break
        return best


def usage_of(seq: Sequence) -> Usage:
    return Usage(
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens or 0,
        num_output_tokens=seq.num_output_tokens,
    )


def timings_of(seq: Sequence) -> Timings:
    assert seq.finished_s is not None
    return Timings(
        arrived_s=seq.arrival_s,
        first_scheduled_s=seq.first_scheduled_s,
        first_token_s=seq.first_token_s,
        finished_s=seq.finished_s,
        num_prefill_chunks=seq.num_prefill_chunks,
        num_preemptions=seq.num_preemptions,
    )
