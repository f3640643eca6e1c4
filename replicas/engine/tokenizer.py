"""Text <-> token ids for the engine, and streaming detokenization.

``Tokenizer`` wraps the transformers tokenizer of the model's own source (the GGUF file's
embedded vocabulary and chat template, or a Hugging Face directory's tokenizer files), loaded
offline. ``IncrementalDetokenizer`` turns a stream of output token ids into text deltas.

NOTE: incremental detokenization follows vLLM's prefix_offset/read_offset scheme. Decoding one
token alone is wrong for byte-level BPE (a character may span tokens) and for SentencePiece
(whether a piece's leading space shows depends on what precedes it), so each step decodes a
short window: ``ids[prefix_offset:read_offset]`` is text already emitted, kept as context, and
``ids[prefix_offset:]`` the same plus the new tokens; the delta is the difference. While the
window's text ends in U+FFFD, the last token ends inside a UTF-8 sequence and the delta is held
back. After each emitted delta the window slides to start at the previous read_offset, so a
step decodes a handful of tokens however long the output is. The window starts in the prompt's
last tokens, so the first output token is decoded in context. For byte-level BPE tokenizers
(SmolLM2, Llama 3, Qwen2) the deltas concatenate to ``Tokenizer.decode(output_token_ids)``; a
SentencePiece tokenizer's decode drops the leading space of its first token, the deltas keep it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from replicas.engine.errors import InvalidRequestError, ModelLoadError

REPLACEMENT_CHAR = "\ufffd"
# prompt tokens decoded before the first output token, as context (vLLM uses the same number)
NUM_PROMPT_CONTEXT_TOKENS = 5
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError)
# tokenizer_class values of a plain tokenizer.json tokenizer (transformers 4, 5)
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    """A transformers tokenizer plus the model's EOS ids."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self._hf = hf_tokenizer
        ids = [*eos_token_ids]
        if hf_tokenizer.eos_token_id is not None:
            ids.append(int(hf_tokenizer.eos_token_id))
        self._eos_token_ids = tuple(dict.fromkeys(ids))

    @classmethod
    def from_gguf(
        cls, path: str, architecture: str | None = None, eos_token_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """The tokenizer and chat template embedded in a GGUF file's metadata.

        ``architecture`` is the file's ``general.architecture`` when the caller knows it.
        """
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        directory, filename = os.path.split(os.path.abspath(path))
        # NOTE: for a llama GGUF, AutoTokenizer picks PreTrainedTokenizerFast after rebuilding
        # the whole model config with gguf's slow reader (about 7 s for SmolLM2); loading that
        # class directly reads only the vocabulary (under 1 s) and gives the same tokenizer.
        loader = PreTrainedTokenizerFast if architecture == "llama" else AutoTokenizer
        try:
            hf_tokenizer = loader.from_pretrained(
                directory, gguf_file=filename, local_files_only=True
            )
        except _LOAD_ERRORS as exc:
            raise ModelLoadError(f"cannot load the GGUF tokenizer ({exc})", path) from exc
        return cls(hf_tokenizer, eos_token_ids)

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """The tokenizer files of a Hugging Face model directory."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # NOTE: AutoTokenizer's model registry costs about 1.5 s of imports; files that name the
        # generic fast tokenizer class (as a prepared GGUF model's do) load with it directly.
        generic = _saved_tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES
        loader = PreTrainedTokenizerFast if generic else AutoTokenizer
        try:
            hf_tokenizer = loader.from_pretrained(path, local_files_only=True)
        except _LOAD_ERRORS as exc:
            raise ModelLoadError(f"cannot load the tokenizer ({exc})", path) from exc
        return cls(hf_tokenizer, eos_token_ids)

    @property
    def hf_tokenizer(self) -> Any:
        return self._hf

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: the model config's and the tokenizer's EOS."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's may be padded larger)."""
        return len(self._hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer's config adds (BOS)."""
        return list(self._hf.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # no clean-up of spaces: streamed deltas could not reproduce it
        return self._hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids of a chat, rendered with the model's template and a generation prompt.

        Raises InvalidRequestError (param "messages") for malformed messages, a model without a
        chat template, or a template that rejects the conversation.
        """
        import jinja2

        _check_messages(messages)
        if not getattr(self._hf, "chat_template", None):
            raise InvalidRequestError("this model has no chat template", param="messages")
        try:
            ids = self._hf.apply_chat_template(
                [dict(message) for message in messages],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
        return list(ids)


class IncrementalDetokenizer:
    """Text deltas of a stream of output tokens (see the module NOTE)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # only the prompt's tail is needed, as context for the first output tokens
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS - 1 :])
        self._token_ids: list[int] = context
        self._num_context_tokens = len(context)
        self._prefix_offset = max(len(context) - NUM_PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(context)
        self._pieces: list[str] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context_tokens :]

    @property
    def text(self) -> str:
        """The output text emitted so far (held-back bytes excluded until ``flush``)."""
        text = "".join(self._pieces)
        self._pieces = [text]
        return text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete (maybe "")."""
        delta = []
        for token_id in token_ids:
            self._token_ids.append(int(token_id))
            delta.append(self._step())
        text = "".join(delta)
        if text:
            self._pieces.append(text)
        return text

    def flush(self) -> str:
        """At the end of the stream: the held-back text, incomplete characters as U+FFFD."""
        text = self._window_delta()
        if text is None:
            return ""
        self._advance()
        self._pieces.append(text)
        return text

    def _step(self) -> str:
        text = self._window_delta()
        if text is None or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or the last token ends inside a UTF-8 sequence
        self._advance()
        return text

    def _window_delta(self) -> str | None:
        decode, ids = self._tokenizer.decode, self._token_ids
        prefix_text = decode(
            ids[self._prefix_offset : self._read_offset], self._skip_special_tokens
        )
        new_text = decode(ids[self._prefix_offset :], self._skip_special_tokens)
        if len(new_text) <= len(prefix_text):
            return None
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)


def _saved_tokenizer_class(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), encoding="utf-8") as file:
            name = json.load(file).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer reports what is wrong
    return name if isinstance(name, str) else None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] is not an object", param="messages")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(f"messages[{i}] lacks a string {key!r}", param="messages")
