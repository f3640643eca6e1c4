"""A migrated request (``GenerateRequest.resume``) as vLLM requests: one plan per open choice.

NOTE: vLLM has no way to start a request part-way through its output, so a resumed choice is
run as a new request whose prompt is the client's prompt followed by the output tokens the
client already has, with ``max_tokens`` and ``min_tokens`` reduced by their number. Its usage
still counts those tokens as output (``ChoiceStream.usage``), and the text of them its client
has not had yet (held back for a stop string or a multi-byte character) leads its first chunk.
What this cannot keep exactly as the uninterrupted run would have had it:

- seeded sampling: vLLM draws a seeded request's randomness from one ``torch.Generator`` per
  request, advanced step by step from the start of the request; the resumed request restarts
  that generator at the resume point, so its draws are those of positions 0, 1, ... and its
  output differs from the uninterrupted run's (it is still the same for the same resume
  point). Greedy output continues exactly (up to the numerics of a prefill against decode).
- ``frequency_penalty`` and ``presence_penalty`` count generated tokens only; the resumed
  tokens are prompt to vLLM, so they no longer count. ``repetition_penalty`` counts prompt
  and output alike and is kept.
- a stop string that began in the resumed text and completes in the new text is not found
  (vLLM looks for stop strings in the new output only).
- a structured-output grammar cannot be advanced over the resumed tokens, so a structured
  choice with resumed tokens is refused (``EngineError``) rather than restarted mid-JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicas.engine.errors import EngineError
from replicas.engine.interface import ChoiceResume, GenerateRequest
from replicas.engine.resume_rules import check_resume as check_any_resume

# the text of a choice's resumed tokens, decoded after the prompt (held-back bytes excluded)
ResumedText = Callable[[tuple[int, ...]], str]


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """One open choice: what vLLM prefills, the output tokens its client already has, the text
    of them still to send, and whether it has no token left to make (it ends at once)."""

    index: int
    prompt_token_ids: tuple[int, ...]
    resumed_token_ids: tuple[int, ...] = ()
    pending_text: str = ""
    is_exhausted: bool = False

    @property
    def num_resumed_tokens(self) -> int:
        return len(self.resumed_token_ids)


def plan_choices(request: GenerateRequest, prompt_token_ids: Sequence[int], vocab_size: int,
                 resumed_text: ResumedText) -> list[ChoicePlan]:
    """The open choices of ``request`` in index order (finished ones of a migration skipped).

    Raises ``InvalidRequestError`` (param "resume") for a resume naming a choice or token out
    of range, more tokens than ``max_tokens``, or no open choice; ``EngineError`` for resumed
    tokens under a structured output (see the module NOTE).
    """
    check_resume(request, vocab_size)
    resumes = {r.index: r for r in request.resume}
    prompt = tuple(prompt_token_ids)
    plans = []
    for index in range(request.sampling.n):
        resume = resumes.get(index)
        if resume is None:
            plans.append(ChoicePlan(index, prompt))
        elif not resume.is_finished:
            plans.append(_resumed_plan(request, prompt, resume, resumed_text))
    return plans


def check_resume(request: GenerateRequest, vocab_size: int) -> None:
    """Every engine's rules for a resume (``resume_rules.check_resume``), plus vLLM's one
    limit: no structured output continued part-way."""
    check_any_resume(request, vocab_size)
    for resume in request.resume:
        if (request.sampling.structured_output is not None and resume.token_ids
                and not resume.is_finished):
            raise EngineError(
                f"{request.request_id}: the vllm engine cannot continue choice {resume.index} "
                "part-way through a structured output (vLLM cannot advance a grammar over "
                "tokens it did not sample)")


def _resumed_plan(request: GenerateRequest, prompt: tuple[int, ...], resume: ChoiceResume,
                  resumed_text: ResumedText) -> ChoicePlan:
    tokens = tuple(resume.token_ids)
    if not tokens:
        return ChoicePlan(resume.index, prompt)
    text = resumed_text(tokens)
    pending = text[min(max(resume.num_text_chars_sent, 0), len(text)):]
    return ChoicePlan(
        index=resume.index,
        prompt_token_ids=prompt + tokens,
        resumed_token_ids=tokens,
        pending_text=pending,
        is_exhausted=len(tokens) >= request.sampling.max_tokens,
    )
