"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``;
this module holds its request, the package's modules the rest.

A response is a chat completion underneath: its ``instructions``, the conversation of its
``previous_response_id`` (stored in Redis: ``router/state/responses.py``) and its ``input``
items become chat messages, its function tools chat tools (``chat``), and it is admitted,
queued, fair-shared, metered and traced as any chat completion (``routes``). The answer comes
back as output items (``output``), whole or as the typed stream events the SDK reads
(``stream_events``); ``objects`` are the answers' models for the OpenAPI document. With
``store`` (the default) the response and its conversation are kept, so any router serves the
next turn.

The request: the ``POST /v1/responses`` body and its input items, strict as OpenAI's document
states them (a field is of its stated type: a 0 is not a false).

NOTE: why the request is here and not in a module of its own. The OpenAPI document names the
schema of a model whose class name another model shares (``NamedFunction`` and ``TextFormat``
are chat request names too) by its module path, ``router__api__responses__TextFormat``: the
request's models stay in ``router.api.responses`` so the served document (and the SDKs
generated from it) keep their names.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.api.openai_models import MAX_TOOLS, REQUIRED_NEEDS_TOOLS, TOOL_NAME, _state_rules


class _Request(BaseModel):
    # strict: a field is of its stated type (a 0 is not a false), as the document says
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    # an output_text given back as it came
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=TOOL_NAME.pattern)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem,
                      Field(union_mode="left_to_right")]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_state_rules)
    schema_rules: ClassVar[tuple[dict[str, Any], ...]] = (REQUIRED_NEEDS_TOOLS,)

    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(None, description="accepted; nothing extra to include "
                                      "(no reasoning, no search)")
    text: TextConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: required needs tools")
        return self
