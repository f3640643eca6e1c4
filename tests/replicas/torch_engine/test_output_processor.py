"""Text deltas, stop strings held back and cut, stop tokens — with the real tokenizer."""

from __future__ import annotations

import time

import pytest

from replicas.engine.config import default_model_path
from replicas.engine.interface import FinishReason
from replicas.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from replicas.torch_engine.output_processor import RequestOutput
from tests.replicas.torch_engine.factories import make_sequence

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path(), "llama", (EOS,))


def _stream(tokenizer: Tokenizer, text: str, **sampling):
    """Feed ``text``'s tokens one by one; returns (deltas, finish reason, tokens fed)."""
    prompt = tokenizer.encode("Say something:")
    seq = make_sequence("r", token_ids=prompt, **sampling)
    out = RequestOutput(seq, IncrementalDetokenizer(tokenizer, prompt), frozenset({EOS}), "r")
    deltas, finish, fed = [], None, 0
    for token in tokenizer.encode(text) + [EOS]:
        seq.append_token(token)
        fed += 1
        finish = out.on_token(token, max_model_len=10_000)
        if finish is not None:
            seq.finished_s = time.time()  # what Scheduler.finish does
        deltas.append(out.chunk((token,), None, finish).text)
        if finish is not None:
            break
    return deltas, finish, fed


def test_deltas_add_up_to_the_text(tokenizer) -> None:
    text = "Hello wörld 👋🏽, 日本語 and ünïcödé — fine."
    deltas, finish, _ = _stream(tokenizer, text, max_tokens=200)
    assert "".join(deltas) == text
    assert finish is FinishReason.STOP  # the EOS token, which adds no text


def test_stop_string_is_held_back_then_cut(tokenizer) -> None:
    text = "The answer is 42. The end"
    deltas, finish, fed = _stream(tokenizer, text, max_tokens=200, stop=("is 42",))
    assert "".join(deltas) == "The answer "
    assert finish is FinishReason.STOP
    assert fed < len(tokenizer.encode(text))  # stopped as soon as the stop string completed
    # "is" was never sent before it was known not to be part of the text
    assert all("is" not in d for d in deltas)


def test_partial_stop_match_is_released(tokenizer) -> None:
    text = "It is 41 and it is 43."
    deltas, finish, _ = _stream(tokenizer, text, max_tokens=200, stop=("is 42",))
    assert "".join(deltas) == text and finish is FinishReason.STOP


def test_length_finish_flushes_held_text(tokenizer) -> None:
    n = len(tokenizer.encode("Hello is"))
    deltas, finish, _ = _stream(tokenizer, "Hello is what", max_tokens=n, stop=("is 42",))
    assert finish is FinishReason.LENGTH
    assert "".join(deltas) == "Hello is"


def test_stop_token_id_ends_without_text(tokenizer) -> None:
    stop_id = tokenizer.encode(" world")[0]
    deltas, finish, _ = _stream(tokenizer, "Hello world again", max_tokens=200, stop_token_ids=(stop_id,))
    assert "".join(deltas) == "Hello" and finish is FinishReason.STOP
