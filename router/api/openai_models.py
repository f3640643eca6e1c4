"""OpenAI's request and response schemas, for the fields fairserve supports.

Requests are ``extra="forbid"``: a field we do not implement is a 400 naming it, never silently
ignored (a client must learn a field had no effect). Accepted: OpenAI's own
sampling fields (``n``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``response_format``, ...) and vLLM's extensions, as vLLM names and bounds them (``ignore_eos``,
``min_tokens``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``stream_options.continuous_usage_stats``), which the field's load and eval tools send.
Responses are declared too, so the OpenAPI document FastAPI serves describes what is really
sent; the SSE chunk models document the ``text/event-stream`` bodies.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas.protocol import (  # the limits the engine checks too: one definition
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)

MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_TOKEN_IDS = 64
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,9})$"  # a logit_bias key: a token id, no leading zeros

# the cross-field rules, as JSON Schema too, so the OpenAPI document states them
STREAM_OPTIONS_NEED_STREAM = {
    "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
    "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]}}
TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
           "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}
REQUIRED_NEEDS_TOOLS = {
    "if": {"properties": {"tool_choice": {"const": "required"}}, "required": ["tool_choice"]},
    "then": {"properties": {"tools": {"type": "array"}}, "required": ["tools"]}}
# a message's fields by its role
MESSAGE_RULES = (
    {"if": {"properties": {"tool_calls": {"type": "array"}}, "required": ["tool_calls"]},
     "then": {"properties": {"role": {"const": "assistant"}}}},
    {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
     "then": {"properties": {"tool_call_id": {"type": "string"}}, "required": ["tool_call_id"]}},
    {"if": {"properties": {"tool_call_id": {"type": "string"}}, "required": ["tool_call_id"]},
     "then": {"properties": {"role": {"const": "tool"}}}},
    {"if": {"not": {"properties": {"role": {"const": "assistant"},
                                   "tool_calls": {"type": "array"}},
                    "required": ["role", "tool_calls"]}},
     "then": {"properties": {"content": {"not": {"type": "null"}}}, "required": ["content"]}},
)
ONE_OF_THE_MAX_TOKENS = {
    "not": {"properties": {"max_tokens": {"type": "integer"},
                           "max_completion_tokens": {"type": "integer"}},
            "required": ["max_tokens", "max_completion_tokens"]}}


def _state_rules(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Adds ``model``'s cross-field rules to its JSON Schema, and says that ``logit_bias`` keys
    are token ids (pydantic writes key patterns as ``patternProperties``, which would let
    other keys through)."""
    schema["allOf"] = list(getattr(model, "schema_rules", ()))
    bias = schema.get("properties", {}).get("logit_bias", {})
    for branch in bias.get("anyOf", []):
        if branch.get("type") == "object":
            (values,) = branch.pop("patternProperties").values()
            branch["propertyNames"] = {"pattern": TOKEN_ID_KEY}
            branch["additionalProperties"] = values


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Request):
    type: Literal["text"]
    text: str


TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64  # in one assistant message of the history


class ToolCallFunction(_Request):
    name: str = Field(pattern=TOOL_NAME.pattern)
    arguments: str = Field(description="the arguments, a JSON object as text")


class ToolCall(_Request):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_state_rules)
    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = MESSAGE_RULES

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="text, or a list of text parts; an assistant message with tool_calls "
        "may have none")
    name: str | None = Field(None, max_length=64)
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | \
        None = Field(None, description="assistant: the tools it called")
    tool_call_id: str | None = Field(None, min_length=1, max_length=128,
                                     description="tool: the call this message answers")

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has them")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message has it")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls may "
                             "leave it out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(_Request):
    name: str = Field(pattern=TOOL_NAME.pattern,
                      description="a-z, A-Z, 0-9, _ and -, at most 64 characters")
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="the arguments' JSON Schema (an object)")
    strict: bool | None = Field(None, description="accepted; with tool_choice required or a "
                                "named function the arguments always match")


class Tool(_Request):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send a last chunk with the usage")
    continuous_usage_stats: bool = Field(
        False, description="vLLM: with include_usage, every chunk carries the usage so far")


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaSpec(_Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=SCHEMA_NAME.pattern,
                      description="a-z, A-Z, 0-9, _ and -, at most 64 characters")
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                        description="the JSON Schema the output must match")
    strict: bool | None = Field(None, description="accepted; the output always matches")




class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class _Sampling(_Request):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_state_rules)
    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (STREAM_OPTIONS_NEED_STREAM,)

    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, description="any integer, taken modulo 2**64")
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
        Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices; at most router.api.max_n")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[
        dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Annotated[float, Field(ge=-100.0, le=100.0)]],
        Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, -100..100; "
        f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    min_tokens: int = Field(0, ge=0, description="vLLM: generate at least this many tokens")
    ignore_eos: bool = Field(False, description="vLLM: do not stop at EOS")
    top_k: int | None = Field(None, ge=-1, description="vLLM: keep the k most likely tokens; "
                              "-1 or 0: all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM: drop tokens under min_p times "
                         "the most likely token's probability")
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description="vLLM: > 1 discourages tokens "
                                      "already in the prompt or the output")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = Field(False, description="vLLM: keep the stop string")
    skip_special_tokens: bool = Field(True, description="vLLM: leave special tokens out of "
                                      "the text")
    spaces_between_special_tokens: bool = Field(
        True, description="vLLM: accepted; applies to slow tokenizers only (every model "
        "fairserve loads has a fast one, whose decoder decides the spacing)")

    @field_validator("seed")
    @classmethod
    def _fold_seed(cls, value: int | None) -> int | None:
        return None if value is None else value % 2**64

    @model_validator(mode="after")
    def _check_shared(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: usage on every chunk (only with include_usage, as vLLM does)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_Sampling):
    schema_rules = (STREAM_OPTIONS_NEED_STREAM, TOP_LOGPROBS_NEED_LOGPROBS, ONE_OF_THE_MAX_TOKENS,
                    REQUIRED_NEEDS_TOOLS)

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer")
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; still honoured")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: max_tokens is set too; send one of them")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: required needs tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or "function:<name>" (a named function)."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return choice if isinstance(choice, str) else f"function:{choice.function.name}"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default is 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    """One ``data:`` line of a streamed completion (then ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A tool call's first delta has its index, id, type and name (and arguments ""); the
    next ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` line of a streamed chat completion (then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    # as vLLM's: the base model of a LoRA adapter (its own id for the base), and the context
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail
