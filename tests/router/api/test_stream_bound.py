"""No request may need more events than one response stream keeps: the stream is capped
(XADD MAXLEN ~, which never trims below the cap), and a trimmed stream could not tell a
takeover what its client was sent (it would resume from the wrong prefix)."""

from __future__ import annotations

import pytest

from replicas.protocol import MAX_N
from router.api.sampling import STREAM_EVENTS_SLACK, stream_max_tokens
from router.state.keys import STREAM_MAX_EVENTS


@pytest.mark.parametrize("n", range(1, MAX_N + 1))
def test_the_largest_allowed_request_fits_its_stream(n: int) -> None:
    most = stream_max_tokens(n)
    assert most > 0
    # one chunk per token at worst, the text-only chunks of each choice, then the end event
    assert n * (most + STREAM_EVENTS_SLACK) + STREAM_EVENTS_SLACK <= STREAM_MAX_EVENTS
    # and it is the largest: one more token per choice could overflow
    assert n * (most + 1 + STREAM_EVENTS_SLACK) + STREAM_EVENTS_SLACK > STREAM_MAX_EVENTS
