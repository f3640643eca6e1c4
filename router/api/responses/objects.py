"""What the document says of the Responses API's answers: OpenAI's Response object (the
fields fairserve fills), its output items and usage, and a deletion's answer. Only the
OpenAPI document reads these; the routes send the dicts ``output.py`` builds."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class MessageOutput(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's Response object, the fields fairserve fills."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Annotated[MessageOutput | FunctionCallOutput, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool
