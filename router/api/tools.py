"""Tool calling in chat completions: the prompt that shows the model its tools, the grammar
that makes ``tool_choice`` ``required`` or a named function always parse, and the parser that
turns the model's text into OpenAI's ``tool_calls``, whole or streamed.

NOTE: the format. A model calls tools in the format it was trained on, which its chat template
renders when the template knows tools. The default model's (SmolLM2-135M-Instruct) does not,
so fairserve renders tools itself, in the format SmolLM2 was tuned on for function calling (and
close to Hermes' and Qwen's): a system message lists the tools as JSON in ``<tools>...</tools>``,
and a call is ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``. An assistant
message of the history that made calls is rendered in that format, a ``tool`` message as the
template renders any role (ChatML: ``<|im_start|>tool``). The parser also takes one call
object per ``<tool_call>`` block (Hermes, Qwen 2.5), so it reads both.

``required`` and a named function constrain decoding to ``<tool_call>`` + a JSON array of
calls whose arguments match each tool's schema (llguidance, as for ``response_format``) +
``</tool_call>``: the arguments always parse and validate. ``auto`` leaves the model free: a
text answer, or a call (a block that does not parse stays text). ``none`` shows no tools.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from replicas.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from router.api.openai_models import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from router.errors import TOOL_REFERENCE, InvalidRequestError

OPEN, CLOSE = TOOL_CALL_OPEN, TOOL_CALL_CLOSE


def check_references(request: ChatCompletionRequest) -> None:
    """What the document cannot state: each tool named once, a named ``tool_choice`` among
    the tools, each ``tool`` message answering a call made before it. 400 naming the field
    (code ``tool_reference_not_found``)."""
    names = [t.function.name for t in request.tools or []]
    problem: tuple[str, str] | None = None
    if len(set(names)) != len(names):
        problem = "tools", "two tools have the same name"
    elif isinstance(request.tool_choice, NamedToolChoice) and \
            request.tool_choice.function.name not in names:
        problem = "tool_choice", f"no tool named {request.tool_choice.function.name!r} in tools"
    else:
        calls: set[str] = set()
        for i, message in enumerate(request.messages):
            calls.update(c.id for c in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id not in calls:
                problem = (f"messages[{i}].tool_call_id", "no assistant message before it "
                           f"made the call {message.tool_call_id!r}")
                break
    if problem is not None:
        raise InvalidRequestError(f"{problem[0]}: {problem[1]}", param=problem[0],
                                  code=TOOL_REFERENCE)


def call_id(request_id: str, choice: int, index: int) -> str:
    """A tool call's id: the same for the same request, however often it is read (a resume,
    a replay after a migration)."""
    digest = hashlib.sha256(f"{request_id}:{choice}:{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def _signature(tool: Tool) -> dict[str, Any]:
    f = tool.function
    return {"type": "function", "function": {"name": f.name, "description": f.description or "",
                                             "parameters": f.parameters}}


def system_prompt(tools: Sequence[Tool], mode: str, parallel: bool) -> str:
    """The tools and how to call them, for the system message."""
    listed = "\n".join(json.dumps(_signature(t)) for t in tools)
    if mode.startswith("function:"):
        rule = f"You must call the function {mode.split(':', 1)[1]}."
    elif mode == "required":
        rule = "You must call one or more of these functions."
    else:
        rule = ("If a function helps to answer, call it; otherwise answer in plain text.")
    many = "one or more function calls" if parallel else "exactly one function call"
    return (f"You have access to the following functions:\n<tools>\n{listed}\n</tools>\n\n"
            f"{rule} To call functions, answer with {many} in this format and nothing else:\n"
            f'{OPEN}[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]{CLOSE}\n'
            "The results come back in messages of the role tool.")


def template_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """The request's messages as the chat template takes them: the tools' system prompt in
    front (joined to the request's own system message, if it starts with one), past calls in
    the call format."""
    messages = [_message(m) for m in request.messages]
    mode = request.tool_mode
    if mode == "none":
        return messages
    assert request.tools is not None
    prompt = system_prompt(request.tools, mode, request.parallel_tool_calls)
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _message(message: ChatMessage) -> dict[str, str]:
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}
                 for c in message.tool_calls]
        text = message.text()
        return {"role": "assistant",
                "content": (f"{text}\n" if text else "") + f"{OPEN}{json.dumps(calls)}{CLOSE}"}
    return {"role": message.role, "content": message.text()}


def _arguments_value(arguments: str) -> Any:
    """A past call's arguments as JSON (its text as it is, if it is not)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def calls_schema(tools: Sequence[Tool], mode: str, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of the array in a ``<tool_call>`` block for ``required`` or a named
    function: each item one of the allowed tools, its arguments under that tool's schema."""
    allowed = [t for t in tools if not mode.startswith("function:")
               or t.function.name == mode.split(":", 1)[1]]
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters}} for t in allowed]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- the model's text -> tool calls ----


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text (json.dumps of what the model wrote)


def parse_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(the text before the first call, or None; the calls) of a whole answer. A block that
    does not parse, or names no function, makes the whole answer text (no calls)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls: list[ParsedCall] = []
    rest = text[start:]
    while rest.startswith(OPEN):
        body = rest[len(OPEN):]
        end = json_end(body)  # the block's JSON ends where its brackets close (a string in it
        if end is None or end < 0:  # may hold anything, the closing tag too)
            return text, []
        after = body[end:].lstrip()
        parsed = _block_calls(body[:end])
        if parsed is None or not after.startswith(CLOSE):
            return text, []
        calls += parsed
        rest = after[len(CLOSE):].lstrip()
    if not calls:
        return text, []
    before = text[:start].rstrip()
    return (before or None), calls


def json_end(text: str) -> int | None:
    """Where the JSON array or object at the start of ``text`` (after spaces) ends: the index
    after its closing bracket; None while it is not closed yet; -1 if it is not an array or
    an object."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return -1
    return None


def _block_calls(body: str) -> list[ParsedCall] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


@dataclass(slots=True)
class CallDeltas:
    """What one piece of streamed text adds: content, and tool-call delta entries (OpenAI's:
    the first of a call has its index, id, type and name, the next add to its arguments)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class StreamingCalls:
    """Turns a choice's streamed text into content and tool-call deltas.

    Content streams as it comes, except a tail that could be the start of ``<tool_call>``
    (held until it is known). Inside a block, ``forced`` (the grammar guarantees the block is
    well formed) streams each call as it is written: its header once its name is complete,
    then its arguments piece by piece. Not forced (``auto``), a block is held until it closes
    and parses, then sent as whole calls; one that does not parse is sent as content."""

    def __init__(self, request_id: str, choice: int, forced: bool) -> None:
        self.request_id, self.choice, self.forced = request_id, choice, forced
        self.num_calls = 0
        self._held = ""  # text not yet sent: a possible opening tag, or an unfinished block
        self._in_block = False
        self._scan = _CallScanner()

    def feed(self, text: str) -> CallDeltas:
        out = CallDeltas()
        self._held += text
        while self._held and (self._block(out) if self._in_block else self._outside(out)):
            pass
        return out

    def _outside(self, out: CallDeltas) -> bool:
        """Text outside a block: sent, up to a possible opening tag; True to go on (a block
        opened)."""
        start = self._held.find(OPEN)
        if start < 0:
            keep = _partial_suffix(self._held, OPEN)
            if self.num_calls == 0:  # text after the calls is dropped, as OpenAI does
                out.content += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            return False
        if self.num_calls == 0 and start:
            out.content += self._held[:start].rstrip()
        self._held = self._held[start + len(OPEN):]
        self._in_block, self._scan = True, _CallScanner()
        return True

    def _block(self, out: CallDeltas) -> bool:
        """Text inside a block; True to go on (the block closed). The block's JSON ends
        where its brackets close, then comes the closing tag."""
        if self.forced and not self._scan.done:
            deltas, used = self._scan.feed(self._held, self)
            out.tool_calls += deltas
            self._held = self._held[used:]
            if not self._scan.done:
                return False
        if not self.forced and not self._scan.done:
            end = json_end(self._held)
            if end is None:
                return False  # held until the block's JSON closes
            parsed = _block_calls(self._held[:end]) if end > 0 else None
            if parsed is None:  # not a call after all: it was text
                self._in_block = False
                if self.num_calls == 0:
                    out.content += OPEN
                return True
            for call in parsed:
                out.tool_calls += self._whole_call(call)
            self._held = self._held[end:]
            self._scan.done = True
        rest = self._held.lstrip()
        if len(rest) < len(CLOSE) and CLOSE.startswith(rest):
            return False  # the closing tag may be coming
        self._held = rest[len(CLOSE):] if rest.startswith(CLOSE) else rest
        self._in_block = False
        return True

    def finish(self) -> CallDeltas:
        """The end of the choice: what is still held (an unfinished block is text)."""
        out = CallDeltas()
        if self._held and self.num_calls == 0:
            out.content = (OPEN if self._in_block else "") + self._held
        self._held = ""
        return out

    def _header(self, name: str) -> dict[str, Any]:
        index = self.num_calls
        self.num_calls += 1
        return {"index": index, "id": call_id(self.request_id, self.choice, index),
                "type": "function", "function": {"name": name, "arguments": ""}}

    def _whole_call(self, call: ParsedCall) -> list[dict[str, Any]]:
        header = self._header(call.name)
        return [header, {"index": header["index"], "function": {"arguments": call.arguments}}]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _CallScanner:
    """Reads a well-formed array of call objects as it streams (the grammar's output):
    ``[{"name": "...", "arguments": {...}}, ...]``, the name before the arguments. Yields a
    call's header when its name is complete and its arguments' text as it comes."""

    def __init__(self) -> None:
        self.depth = 0  # brackets open: 1 inside the array, 2 inside a call
        self.in_string = self.escaped = False
        self.key = ""  # the key of the value being read at depth 2
        self.reading_key = False
        self.token = ""  # a key's or the name's text so far
        self.in_arguments = False
        self.arguments_depth = 0
        self.index = -1
        self.done = False  # the array has closed

    def feed(self, text: str, stream: StreamingCalls) -> tuple[list[dict[str, Any]], int]:
        """The deltas of ``text``, and how much of it the block's JSON took (all of it, or
        up to its closing bracket: then ``done``)."""
        out: list[dict[str, Any]] = []
        piece = ""
        used = 0
        for ch in text:
            if self.done:
                break
            used += 1
            if self.in_arguments:
                piece += ch
                if self._arguments_char(ch):  # the arguments' value ended
                    out.append({"index": self.index, "function": {"arguments": piece}})
                    piece, self.in_arguments = "", False
                continue
            if self._structure_char(ch, stream, out):  # the arguments begin with ch
                piece = ch
        if piece:
            out.append({"index": self.index, "function": {"arguments": piece}})
        return out, used

    def _in_string(self, ch: str) -> bool:
        """One character inside a JSON string; True when it closes the string."""
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _string_char(self, ch: str, stream: StreamingCalls, out: list[dict[str, Any]]) -> None:
        """A key's or the name's string: its header once the name is complete."""
        if not self._in_string(ch):
            self.token += ch
            return
        value = json.loads(f'"{self.token}"')
        if self.reading_key:
            self.key, self.reading_key = value, False
        elif self.key == "name":
            out.append(stream._header(value))
            self.index = out[-1]["index"]

    def _arguments_char(self, ch: str) -> bool:
        if self.in_string:
            self._in_string(ch)
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.arguments_depth += 1
        elif ch in "}]":
            self.arguments_depth -= 1
            return self.arguments_depth == 0
        return False

    def _structure_char(self, ch: str, stream: StreamingCalls, out: list[dict[str, Any]]
                        ) -> bool:
        """Reads one character outside the arguments; True when it opens them."""
        if self.in_string:
            self._string_char(ch, stream, out)
            return False
        if ch == '"':
            self.in_string, self.token = True, ""
            if self.depth == 2 and self.key == "":
                self.reading_key = True
        elif ch in "{[":
            if self.depth == 2 and self.key == "arguments":
                self.in_arguments, self.arguments_depth = True, 1
                return True
            self.depth += 1
            if self.depth == 2:
                self.key = ""
        elif ch in "}]":
            self.depth -= 1
            self.key = ""
            self.done = self.depth == 0  # the array closed: the block's JSON ends here
        elif ch == "," and self.depth == 2:
            self.key = ""
        return False
