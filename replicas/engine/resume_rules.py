"""What a resumed request (a migration's ``GenerateRequest.resume``) must satisfy on any engine."""

from __future__ import annotations

from replicas.engine.errors import InvalidRequestError
from replicas.engine.interface import GenerateRequest


def check_resume(request: GenerateRequest, vocab_size: int) -> None:
    """Raises ``InvalidRequestError`` (param ``resume``) for a choice or token id out of range,
    more resumed tokens than ``max_tokens``, or a request whose every choice has ended."""
    for resume in request.resume:
        if not 0 <= resume.index < request.sampling.n or any(
                not 0 <= t < vocab_size for t in resume.token_ids):
            raise InvalidRequestError(
                f"resume of choice {resume.index}: the choice or a token id is out of range",
                "resume")
        if len(resume.token_ids) > request.sampling.max_tokens:
            raise InvalidRequestError(f"resume of choice {resume.index}: more tokens than "
                                      "max_tokens", "resume")
    if request.num_open_choices < 1:
        raise InvalidRequestError("resume: every choice has ended already", "resume")
