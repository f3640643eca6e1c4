"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: its ``instructions``, the conversation of its
``previous_response_id`` (stored in Redis: ``router/state/responses.py``) and its ``input``
items become chat messages, its function tools chat tools (``chat.py``), and it is admitted,
queued, fair-shared, metered and traced as any chat completion. The answer comes back as
output items (``output.py``), whole or as the typed stream events the SDK reads
(``stream_events.py``). With ``store`` (the default) the response and its conversation are
kept, so any router serves the next turn.

- ``request``: the request body and its input items
- ``chat``: the request as the chat completion it runs as
- ``output``: the answer as the Response object and its output items
- ``stream_events``: the answer as the typed stream events
- ``objects``: the answers' models, for the OpenAPI document
- ``routes``: the routes
"""

from router.api.responses.chat import chat_request, input_messages
from router.api.responses.objects import ResponseDeleted, ResponseObject
from router.api.responses.output import (
    finished,
    output_items,
    response_id,
    response_skeleton,
)
from router.api.responses.request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
)
from router.api.responses.routes import register
from router.api.responses.stream_events import StreamEvents

__all__ = [
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "MessageItem",
    "ResponseDeleted",
    "ResponseObject",
    "ResponsesRequest",
    "StreamEvents",
    "chat_request",
    "finished",
    "input_messages",
    "output_items",
    "register",
    "response_id",
    "response_skeleton",
]
