"""Prompt tokens on the router: counted before anything is queued, sent to replicas as ids.

The router must know a prompt's length to check the context limit and reserve tokens, and it
must not load torch or the model. The cluster builder hands it a ``ModelInfo``
(``replicas.protocol``): the model's limits and its tokenizer as the files ``save_pretrained``
writes (taken from the model's own source, so chat templates and special tokens are the
engine's). The router sends the token ids
it counted, so the replica runs exactly what was reserved.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicas.protocol import ModelInfo
from router.api.tools import takes_tools, tool_format
from router.errors import InvalidRequestError


class PromptTokenizer:
    def __init__(self, info: ModelInfo) -> None:
        from transformers import PreTrainedTokenizerFast  # pure tokenizers: no torch

        with tempfile.TemporaryDirectory(prefix="fairserve-tokenizer-") as directory:
            for name, content in info.tokenizer_files.items():
                (Path(directory) / name).write_bytes(content)
            self._hf: Any = PreTrainedTokenizerFast.from_pretrained(directory)
        if info.chat_template is not None:
            self._hf.chat_template = info.chat_template
        template = getattr(self._hf, "chat_template", None)
        self.tool_format = tool_format(info.tool_call_parser, template)
        # a template that takes `tools` renders them and the past calls itself
        self.template_takes_tools = isinstance(template, str) and takes_tools(template)
        self._piece_cache: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text))

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of a chat rendered with the model's template and a generation prompt (and the
        tools, for a template that takes them)."""
        import jinja2

        if not getattr(self._hf, "chat_template", None):
            raise InvalidRequestError("this model has no chat template", param="messages")
        try:
            ids = self._hf.apply_chat_template(
                [dict(m) for m in messages], tools=tools, add_generation_prompt=True,
                tokenize=True, return_dict=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
        return list(ids)

    def piece(self, token_id: int) -> str:
        """The text of one token alone (OpenAI's ``logprobs`` token strings)."""
        text = self._piece_cache.get(token_id)
        if text is None:
            text = self._hf.decode([token_id], clean_up_tokenization_spaces=False)
            self._piece_cache[token_id] = text
        return text

    @property
    def vocab_size(self) -> int:
        return len(self._hf)
