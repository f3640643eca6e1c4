"""OpenAI's chat and completions objects, built from a request's response events.

A ``Shape`` is what the shaping needs to know of the request (chat or completions, its choices,
usage and logprobs options, id, model, creation time); it is stored with the request at
admission, so a client that reconnects (``GET /v1/chat/completions/{id}``) gets the same
objects as the one that sent it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from router.api.openai_models import ChatCompletionRequest, CompletionRequest
from router.api.tools import StreamingCalls, call_id, parse_calls
from router.dispatch.response_events import ChunkData, EndData
from router.telemetry.request_observer import PhaseTimes


@dataclass(frozen=True, slots=True)
class Shape:
    request_id: str
    is_chat: bool
    model: str
    created_s: int
    prompt_tokens: int
    num_choices: int = 1
    include_usage: bool = False
    continuous_usage: bool = False
    wants_logprobs: bool = False
    base: str = ""  # the base model that serves it (its tokenizer reads the logprobs' ids)
    # chat with tools: "auto" (the answer may hold calls) or "forced" (it is calls, under the
    # grammar); "none": no tools (router/api/tools.py)
    tool_mode: str = "none"

    @classmethod
    def of(cls, body: ChatCompletionRequest | CompletionRequest, request_id: str, model: str,
           prompt_tokens: int, base: str = "") -> Shape:
        is_chat = isinstance(body, ChatCompletionRequest)
        mode = body.tool_mode if isinstance(body, ChatCompletionRequest) else "none"
        return cls(request_id, is_chat, model, int(time.time()), prompt_tokens, body.n,
                   body.include_usage, body.continuous_usage,
                   bool(body.logprobs) if is_chat else body.logprobs is not None, base,
                   mode if mode in ("none", "auto") else "forced")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> Shape:
        return cls(**fields)


class Shaper:
    """Builds OpenAI's chat or completions objects from response events, for ``n`` choices.

    Streams are OpenAI's: a chat stream opens each choice with its role; each chunk carries one
    choice (by ``index``); a choice's last chunk has its ``finish_reason``; with
    ``include_usage`` a last chunk with empty ``choices`` has the usage, and with vLLM's
    ``continuous_usage_stats`` every chunk has the usage so far.
    """

    def __init__(self, shape: Shape, piece: Callable[[int], str]) -> None:
        """``piece``: a token id's text (the response stream's logprobs carry ids)."""
        self.piece = piece
        self.is_chat = shape.is_chat
        self.include_usage = shape.include_usage
        self.continuous_usage = shape.continuous_usage
        self.num_choices = shape.num_choices
        self.id = shape.request_id
        self.model = shape.model
        self.created = shape.created_s
        self.prompt_tokens = shape.prompt_tokens
        self.num_tokens = 0  # all choices together
        self.texts: list[list[str]] = [[] for _ in range(shape.num_choices)]  # not streaming
        self.num_chars = [0] * shape.num_choices  # each choice's text so far (streaming)
        self.logprobs: list[list[Any]] = [[] for _ in range(shape.num_choices)]
        self.finished: set[int] = set()
        self.wants_logprobs = shape.wants_logprobs
        self.tool_mode = shape.tool_mode if self.is_chat else "none"
        # with tools, each choice's text goes through a parser (router/api/tools.py)
        self.calls = [StreamingCalls(self.id, i, self.tool_mode == "forced")
                      for i in range(self.num_choices)] if self.tool_mode != "none" else []
        # NOTE: a stream's token chunk is the hottest object the router builds: in the common
        # case (no logprobs, no usage per chunk) its JSON is put together from these two
        # pieces and the chunk's text, byte for byte what ``_data(delta(...))`` writes
        # (tests/router/test_shaper.py holds them equal).
        self._is_plain = not self.wants_logprobs and not self.continuous_usage and not self.calls
        head = self._envelope([], True)
        head.pop("usage", None)
        self._head = json.dumps(head, separators=(",", ":"))[:-3] + '[{"index":'
        self._tail = "}]" + (',"usage":null}' if self.include_usage else "}")
        self._text_key = '"delta":{"content":' if self.is_chat else '"text":'

    def _envelope(self, choices: list[dict[str, Any]], streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if self.is_chat \
            else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created,
                               "model": self.model, "choices": choices}
        if streaming and self.include_usage:
            out["usage"] = None if not self.continuous_usage else {
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.prompt_tokens + self.num_tokens}
        return out

    def _choice(self, index: int, text: str | None, logprobs: Any,
                finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.is_chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        return choice

    def add(self, chunk: ChunkData) -> None:
        self.num_tokens += chunk.num_tokens
        self.texts[chunk.index].append(chunk.text)
        if chunk.logprobs:
            self.logprobs[chunk.index].extend(chunk.logprobs)

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the role (as OpenAI's do); completions start
        with text."""
        if not self.is_chat:
            return []
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], True)
                for i in range(self.num_choices)]

    def delta(self, chunk: ChunkData) -> dict[str, Any] | None:
        """The one stream chunk of a chunk event (its text, and its choice's finish reason if
        it is the last: one event, one SSE message, so an event id names all it carried)."""
        index = chunk.index
        offset = self.num_chars[index]
        logprobs = self._logprobs(chunk.logprobs or [], offset) if self.wants_logprobs else None
        self.num_tokens += chunk.num_tokens
        self.num_chars[index] += len(chunk.text)
        if self.calls:
            return self._tools_delta(chunk, logprobs)
        if chunk.finish_reason is not None:
            self.finished.add(index)
        elif not (chunk.text or chunk.num_tokens):
            return None
        text = chunk.text if (chunk.text or chunk.num_tokens) else None
        return self._envelope([self._choice(index, text, logprobs, chunk.finish_reason)], True)

    def _tools_delta(self, chunk: ChunkData, logprobs: Any) -> dict[str, Any] | None:
        """A chunk of a chat with tools: its content and tool-call deltas (one message: an
        event id names all it carried); the last one says ``tool_calls`` if calls were made."""
        calls = self.calls[chunk.index]
        deltas = calls.feed(chunk.text)
        finish = chunk.finish_reason
        if finish is not None:
            self.finished.add(chunk.index)
            rest = calls.finish()
            deltas.content += rest.content
            if calls.num_calls and finish == "stop":
                finish = "tool_calls"
        if not (deltas.content or deltas.tool_calls or finish is not None or logprobs):
            return None
        delta: dict[str, Any] = {}
        if deltas.content:
            delta["content"] = deltas.content
        if deltas.tool_calls:
            delta["tool_calls"] = deltas.tool_calls
        choice = {"index": chunk.index, "logprobs": logprobs, "finish_reason": finish,
                  "delta": delta}
        return self._envelope([choice], True)

    def delta_sse(self, chunk: ChunkData, event_id: str) -> str:
        """``delta``'s chunk as its SSE message (``""`` when there is none)."""
        if not self._is_plain or not (chunk.text or chunk.num_tokens):
            payload = self.delta(chunk)
            return "" if payload is None else sse_data(payload, event_id)
        self.num_tokens += chunk.num_tokens
        self.num_chars[chunk.index] += len(chunk.text)
        finish = chunk.finish_reason
        if finish is not None:
            self.finished.add(chunk.index)
        text = json.dumps(chunk.text)
        end = "}" if self.is_chat else ""
        reason = "null" if finish is None else json.dumps(finish)
        return (f"id: {event_id}\ndata: {self._head}{chunk.index},\"logprobs\":null,"
                f"\"finish_reason\":{reason},{self._text_key}{text}{end}{self._tail}\n\n")

    def _finish_chunk(self, index: int, reason: str | None) -> dict[str, Any]:
        self.finished.add(index)
        choice = self._choice(index, None, None, reason)
        if self.calls:  # what the parser still holds, and the calls' finish reason
            calls = self.calls[index]
            rest = calls.finish()
            if rest.content:
                choice["delta"] = {"content": rest.content}
            if calls.num_calls and reason == "stop":
                choice["finish_reason"] = "tool_calls"
        return self._envelope([choice], True)

    def last_chunks(self, end: EndData, phases: PhaseTimes) -> list[dict[str, Any]]:
        reasons = self._reasons(end)
        chunks = [self._finish_chunk(i, reasons[i]) for i in range(self.num_choices)
                  if i not in self.finished]
        if self.include_usage:
            usage = self._envelope([], True)
            usage["usage"] = usage_of(end, phases)
            chunks.append(usage)
        return chunks

    def _reasons(self, end: EndData) -> list[str | None]:
        """Each choice's finish reason (one choice: the request's)."""
        if end.finish_reasons is not None:
            return list(end.finish_reasons)
        return [end.finish_reason] * self.num_choices

    def final(self, end: EndData, phases: PhaseTimes) -> dict[str, Any]:
        reasons = self._reasons(end)
        choices = []
        for i in range(self.num_choices):
            text = "".join(self.texts[i])
            logprobs = self._logprobs(self.logprobs[i], 0) if self.wants_logprobs else None
            choice: dict[str, Any] = {"index": i, "logprobs": logprobs,
                                      "finish_reason": reasons[i]}
            if not self.is_chat:
                choice["text"] = text
            elif self.tool_mode == "none":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                content, calls = parse_calls(text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [
                        {"id": call_id(self.id, i, k), "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}}
                        for k, c in enumerate(calls)]
                    if reasons[i] == "stop":
                        choice["finish_reason"] = "tool_calls"
            choices.append(choice)
        out = self._envelope(choices, False)
        out["usage"] = usage_of(end, phases)
        return out

    def _logprobs(self, items: list[Any], offset: int) -> dict[str, Any]:
        """OpenAI's logprobs of ``items`` (``[id, logprob, [[id, logprob], ...]]`` each, as
        the stream has them), the text of the first starting at ``offset``."""
        piece = self.piece
        named = [(piece(tid), lp, [(piece(t), p) for t, p in top]) for tid, lp, top in items]
        if self.is_chat:
            return {"content": [{
                "token": tok, "logprob": lp, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())}
                                 for t, p in top]} for tok, lp, top in named]}
        offsets, position = [], offset
        for tok, _, _ in named:
            offsets.append(position)
            position += len(tok)
        return {"tokens": [tok for tok, _, _ in named],
                "token_logprobs": [lp for _, lp, _ in named],
                "top_logprobs": [dict(top) for _, _, top in named],
                "text_offset": offsets}


def sse_data(payload: dict[str, Any], event_id: str | None = None) -> str:
    """One SSE message of a JSON payload, with its event id if it has one."""
    data = f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
    return data if event_id is None else f"id: {event_id}\n{data}"


def usage_of(end: EndData, phases: PhaseTimes) -> dict[str, Any]:
    """OpenAI's usage, plus ``timings_ms``: where the request's time went (queue,
    engine_queue, prefill, decode), as in the ``Server-Timing`` header."""
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
            "timings_ms": phases.as_ms()}
