"""Tool calling in chat completions: the prompt that shows the model its tools, the grammar
that makes ``tool_choice`` ``required`` or a named function always parse, and the parser that
turns the model's text into OpenAI's ``tool_calls``, whole or streamed.

NOTE: the formats. A model calls tools in the format it was trained on, chosen per model by
``engine.tool_call_parser`` (``ToolFormat``):
- ``hermes`` (Hermes 2 Pro/3, Qwen 2.5/3 and the models tuned on their data): a call is one
  ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` block, one block per call.
  Their chat templates take ``tools`` and render the tools, past calls and results themselves:
  they are given OpenAI's messages and the tools, so the prompt is the one the model learned.
- ``fairserve``: the default model's (SmolLM2-135M-Instruct's template knows no tools, and it
  was tuned on calls in this layout): fairserve's own system prompt lists the tools as JSON in
  ``<tools>...</tools>``, and a call is ``<tool_call>[{"name": ..., "arguments": {...}},
  ...]</tool_call>``, one block holding the array of calls. A ``tool`` message is rendered as
  the template renders any role (ChatML: ``<|im_start|>tool``); under ``auto``, a
  conversation that ends with tool results gets a last system message (``RESULTS_NOTE``) that
  asks for the answer unless another function is needed.
The parser reads both (a block holding an array or one call object), whole or streamed.

``required`` and a named function constrain decoding to the model's format with each call's
arguments under its tool's schema (llguidance, as for ``response_format``): the arguments
always parse and validate; at most ``MAX_FORCED_CALLS`` calls. ``auto`` leaves the model free:
a text answer, or calls (a block that does not parse stays text). ``none`` shows no tools.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from replicas.protocol import MAX_FORCED_CALLS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
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


class ToolFormat(enum.StrEnum):
    """How a model writes its calls (``engine.tool_call_parser``)."""

    FAIRSERVE = "fairserve"  # one block, a JSON array of calls: the default model's
    HERMES = "hermes"  # one block per call object: Hermes 2 Pro/3, Qwen 2.5/3


def takes_tools(template: str) -> bool:
    """Whether a chat template renders the request's ``tools`` (it reads that variable)."""
    return re.search(r"\btools\b", template) is not None


def tool_format(parser: str, template: str | None) -> ToolFormat:
    """The format ``engine.tool_call_parser`` names; ``auto``: Hermes' for a template that
    takes tools and writes ``<tool_call>`` (it was trained on them), else fairserve's."""
    if parser != "auto":
        return ToolFormat(parser)
    if template and takes_tools(template) and OPEN in template:
        return ToolFormat.HERMES
    return ToolFormat.FAIRSERVE


def _example(fmt: ToolFormat, parallel: bool) -> str:
    call = '{"name": "function_name", "arguments": {"argument": "value"}}'
    if fmt is ToolFormat.HERMES:
        many = "one block for each call" if parallel else "exactly one block"
        return f"{many}, in this format and nothing else:\n{OPEN}\n{call}\n{CLOSE}\n"
    many = "one or more function calls" if parallel else "exactly one function call"
    return f"{many} in this format and nothing else:\n{OPEN}[{call}]{CLOSE}\n"


def system_prompt(tools: Sequence[Tool], mode: str, parallel: bool,
                  fmt: ToolFormat = ToolFormat.FAIRSERVE) -> str:
    """The tools and how to call them, for the system message (a template that does not
    render tools itself)."""
    listed = "\n".join(json.dumps(_signature(t)) for t in tools)
    if mode.startswith("function:"):
        rule = f"You must call the function {mode.split(':', 1)[1]}."
    elif mode == "required":
        rule = "You must call one or more of these functions."
    else:  # without the second half, a small model calls the same tool again every turn
        rule = ("Call a function only if its result is not in the conversation yet; "
                "otherwise answer in plain text.")
    return (f"You have access to the following functions:\n<tools>\n{listed}\n</tools>\n\n"
            f"{rule} To call functions, answer with {_example(fmt, parallel)}"
            "The results come back in messages of the role tool.")


# after the tool results that end a conversation, under `auto` (fairserve's format only)
RESULTS_NOTE = ("The function results are above: use them to answer the user in plain text, "
                "unless another function is needed.")


@dataclass(slots=True)
class ChatPrompt:
    """What the chat template is given: the messages, and the tools for a template that
    renders them itself."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    def num_chars(self) -> int:
        return len(json.dumps(self.messages)) + len(json.dumps(self.tools or []))


def chat_prompt(request: ChatCompletionRequest, fmt: ToolFormat = ToolFormat.FAIRSERVE,
                template_takes_tools: bool = False) -> ChatPrompt:
    """The request's messages as the chat template takes them. A template that takes tools
    gets OpenAI's messages (past calls with their arguments as objects, tool results with
    their call's id) and the tools, and renders the prompt the model was trained on. Else
    fairserve's tools prompt goes into the system message (joined to the request's own, if
    it starts with one) and past calls are written in the model's format."""
    mode = request.tool_mode
    if template_takes_tools:
        tools = [_signature(t) for t in request.tools or []] if mode != "none" else None
        return ChatPrompt([_openai_message(m) for m in request.messages], tools)
    messages: list[dict[str, Any]] = [_message(m, fmt) for m in request.messages]
    if mode != "none":
        assert request.tools is not None
        prompt = system_prompt(request.tools, mode, request.parallel_tool_calls, fmt)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        if mode == "auto" and messages[-1]["role"] == "tool":
            # without it, a small model calls the same function again after every result (the
            # rule in the tools prompt alone was not enough for the default model, greedy)
            messages.append({"role": "system", "content": RESULTS_NOTE})
    return ChatPrompt(messages)


def _message(message: ChatMessage, fmt: ToolFormat) -> dict[str, str]:
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}
                 for c in message.tool_calls]
        text = message.text()
        if fmt is ToolFormat.HERMES:
            written = "\n".join(f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls)
        else:
            written = f"{OPEN}{json.dumps(calls)}{CLOSE}"
        return {"role": "assistant", "content": (f"{text}\n" if text else "") + written}
    return {"role": message.role, "content": message.text()}


def _openai_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments_value(c.function.arguments)}}
            for c in message.tool_calls]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


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
    schema["maxItems"] = MAX_FORCED_CALLS if parallel else 1
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
    """Reads a block's well-formed calls as they stream (the grammar's output): an array of
    call objects ``[{"name": "...", "arguments": {...}}, ...]`` (fairserve's format) or one
    call object (Hermes'), the name before the arguments. Yields a call's header when its name
    is complete and its arguments' text as it comes."""

    def __init__(self) -> None:
        self.depth = 0  # brackets open: 1 inside the array, 2 inside a call
        self.call_depth = 2  # the depth inside a call: 1 where the block is one call object
        self.in_string = self.escaped = False
        self.key = ""  # the key of the value being read inside a call
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
            if self.depth == self.call_depth and self.key == "":
                self.reading_key = True
        elif ch in "{[":
            if self.depth == self.call_depth and self.key == "arguments":
                self.in_arguments, self.arguments_depth = True, 1
                return True
            if self.depth == 0 and ch == "{":
                self.call_depth = 1
            self.depth += 1
            if self.depth == self.call_depth:
                self.key = ""
        elif ch in "}]":
            self.depth -= 1
            self.key = ""
            self.done = self.depth == 0  # the array closed: the block's JSON ends here
        elif ch == "," and self.depth == self.call_depth:
            self.key = ""
        return False
