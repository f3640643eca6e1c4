"""Where a request stands, per choice: the output tokens its client has been sent, their text,
and whether the choice has ended. What a migration resumes from.

The replicas write the chunks; the dispatcher learns each choice's end from its replica's report
(``finish``), and reads the whole of it back from the request's response stream in Redis before
it migrates or takes a request over (the one that had it died, or gave it back): the stream is
the record of what the client was sent, every chunk event carrying its choice, its token ids and
the position it brings the choice to (``router/dispatch/response_events.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replicas.protocol import CallResume
from router.dispatch.response_events import CHUNK, ChunkData, parse
from router.messages import StreamEvent


@dataclass(slots=True)
class ChoiceProgress:
    token_ids: list[int] = field(default_factory=list)  # read back from the stream
    num_text_chars: int = 0
    finish_reason: str | None = None
    num_tokens: int = 0  # the choice's output tokens in the stream

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Progress:
    num_choices: int = 1
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)

    def choice(self, index: int) -> ChoiceProgress:
        return self.choices.setdefault(index, ChoiceProgress())

    def add(self, chunk: ChunkData, token_ids: list[int]) -> int:
        """Record a chunk sent to the client; returns the position it brings its choice to."""
        choice = self.choice(chunk.index)
        choice.token_ids.extend(token_ids)
        choice.num_tokens = len(choice.token_ids)
        choice.num_text_chars += len(chunk.text)
        if chunk.finish_reason is not None:
            choice.finish_reason = chunk.finish_reason
        return choice.num_tokens

    def finish(self, index: int, finish_reason: str | None, num_tokens: int) -> None:
        """A choice ended with ``num_tokens`` output tokens in the stream (its replica says)."""
        choice = self.choice(index)
        choice.finish_reason = finish_reason or "stop"
        choice.num_tokens = num_tokens

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    @property
    def is_finished(self) -> bool:
        return (len(self.choices) == self.num_choices
                and all(c.is_finished for c in self.choices.values()))

    def resume(self) -> tuple[CallResume, ...]:
        """The ``resume`` of a replica call: each choice that has started."""
        return tuple(CallResume(i, tuple(c.token_ids), c.num_text_chars, c.is_finished)
                     for i, c in sorted(self.choices.items()))

    @classmethod
    def from_events(cls, events: list[StreamEvent], num_choices: int) -> Progress:
        """What the client was sent, read back from the response stream."""
        progress = cls(num_choices)
        for event in events:
            if event.type != CHUNK:
                continue
            chunk = parse(event)
            assert isinstance(chunk, ChunkData)
            progress.add(chunk, chunk.token_ids or [])
        return progress
