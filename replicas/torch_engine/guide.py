"""Structured output in the engine: one llguidance matcher per sequence, a token mask per step.

NOTE: before each sampling step the rows with a ``Guide`` get the grammar's bitmask of allowed
next tokens (one bit per token, 32 to an int32 word), and every other token's logit becomes
-inf, before temperature and the filters, so whatever is sampled keeps the output inside the
grammar. The sampled token is then fed to the matcher. When the matcher is stopped (the JSON is
complete and nothing may follow), the sequence finishes with ``stop``, without waiting for the
model to choose EOS. The grammar is built by ``replicas/protocol/grammar.py``, the same function the
router checked it with. The llguidance tokenizer (about 0.3 s to build from the model's) is
made on first use, so replicas that never see a ``response_format`` do not pay for it.
"""

from __future__ import annotations

import threading
from typing import Any

import llguidance
import llguidance.hf
import torch

from replicas.engine.errors import InvalidRequestError
from replicas.engine.sampling_params import StructuredOutput
from replicas.engine.tokenizer import Tokenizer
from replicas.protocol import GrammarError, grammar_for

BITS = 32
PARAM = "response_format"


class Guide:
    """One sequence's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """row: (vocab_words,) int32, contiguous, on the CPU: set to the allowed tokens."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Feed the sampled token; False if the grammar refused it (the mask allowed only
        tokens it takes, so this means every token was masked out by something else)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())


class GuideFactory:
    """Compiles ``StructuredOutput`` specs against one model's tokenizer; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def guide(self, spec: StructuredOutput) -> Guide:
        """A fresh matcher for ``spec``; ``InvalidRequestError`` naming ``response_format``
        when the grammar does not compile."""
        try:
            grammar = grammar_for(spec.kind.value, spec.schema)
        except GrammarError as exc:
            raise InvalidRequestError(f"{PARAM}: {exc}", PARAM) from None
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"{PARAM}: {matcher.get_error()}", PARAM)
        return Guide(matcher)

    def _llguidance_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf_tokenizer, n_vocab=self._vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer


def apply_guides(logits: torch.Tensor, guides: list[Guide]) -> torch.Tensor:
    """logits: (rows, vocab), row i constrained by guides[i]; disallowed tokens get -inf, in
    place."""
    num_rows, vocab = logits.shape
    words = -(-vocab // BITS)
    bitmask = torch.empty((num_rows, words), dtype=torch.int32)
    for i, guide in enumerate(guides):
        guide.fill_bitmask(bitmask[i])
    shifts = torch.arange(BITS, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(num_rows, words * BITS)
    return logits.masked_fill_(~allowed[:, :vocab].to(logits.device), float("-inf"))
