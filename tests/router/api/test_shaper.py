"""A stream chunk's SSE text: the fast path (put together from strings) writes exactly what
the general one (a dict through ``json.dumps``) writes, for every shape and text."""

from __future__ import annotations

import json

import pytest

from router.api.shaper import Shape, Shaper, sse_data
from router.dispatch.response_events import ChunkData

TEXTS = ["Hello", " wörld", 'a "quoted"\n\tline\\', "🙂 emoji", "", "\u2028\x00"]


@pytest.mark.parametrize("is_chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("num_choices", [1, 3])
def test_fast_chunks_equal_the_general_ones(is_chat: bool, include_usage: bool,
                                            num_choices: int) -> None:
    shape = Shape('req-"x"', is_chat, "Smol\u00e9/LM", 1_700_000_000, 12, num_choices,
                  include_usage)
    fast, general = Shaper(shape, str), Shaper(shape, str)
    assert fast._is_plain
    for step, text in enumerate(TEXTS):
        for index in range(num_choices):
            finish = "length" if step == len(TEXTS) - 1 else None
            chunk = ChunkData(text, 1 if text else 0, None, index, finish)
            event_id = f"{step}-{index}"
            payload = general.delta(chunk)
            expected = "" if payload is None else sse_data(payload, event_id)
            got = fast.delta_sse(chunk, event_id)
            assert got == expected
            if got:
                body = json.loads(got.split("data: ", 1)[1])
                assert body["choices"][0]["index"] == index
    assert fast.num_tokens == general.num_tokens
    assert fast.num_chars == general.num_chars == [sum(map(len, TEXTS))] * num_choices
    assert fast.finished == general.finished == set(range(num_choices))


def test_logprob_offsets_count_the_text_sent_before() -> None:
    pieces = {7: "ab", 9: "cde", 4: "x"}
    shaper = Shaper(Shape("r", False, "m", 1, 3, wants_logprobs=True), pieces.__getitem__)
    shaper.delta_sse(ChunkData("ab", 1, [[7, -0.5, []]]), "1-0")
    second = shaper.delta_sse(ChunkData("cde", 1, [[9, -0.1, [[9, -0.1], [4, -3.0]]]]), "2-0")
    body = json.loads(second.split("data: ", 1)[1])
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [2]
    assert logprobs["tokens"] == ["cde"]
    assert logprobs["top_logprobs"] == [{"cde": -0.1, "x": -3.0}]
    assert body["choices"][0]["text"] == "cde"
