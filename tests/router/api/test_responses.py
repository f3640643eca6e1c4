"""The Responses API's pieces (router/api/responses/, router/state/responses.py): input items
as chat messages, bad fields named as the Responses request names them, an answer as output
items and as the typed stream events, and the store: per tenant, bounded, expiring."""

from __future__ import annotations

import json

import pytest

from router.api.responses import ResponsesRequest
from router.api.responses.chat import chat_request, input_messages
from router.api.responses.output import finished, response_skeleton
from router.api.responses.stream_events import StreamEvents
from router.dispatch.response_events import EndData
from router.errors import InvalidRequestError
from router.state import keys
from router.state.redis_client import connect
from router.state.responses import ResponsesSettings, ResponseStore, StoredResponse
from tests.router.factories import run

TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _request(**fields: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def test_input_items_become_chat_messages_calls_made_together_in_one() -> None:
    request = _request(input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "21 C"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Warm.", "annotations": []}]}],
        tools=[TOOL], instructions="Be brief.")
    messages = input_messages(request)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    chat = chat_request(request, [])
    assert chat.messages[0].role == "system" and chat.messages[0].text() == "Be brief."
    assert chat.tools[0].function.name == "get_weather" and chat.tool_mode == "auto"


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input[0].call_id"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"max_output_tokens": 10, "input": [{"role": "user", "content": "x"}],
      "text": {"format": {"type": "json_schema", "name": "n",
                          "schema": {"type": "object", "x-bad": 1}}}}, None),
])
def test_bad_fields_are_named_as_the_responses_request_names_them(fields, param) -> None:
    if param is None:  # this one is fine: it compiles at admission, not here
        chat_request(_request(**fields), [])
        return
    with pytest.raises(InvalidRequestError) as caught:
        chat_request(_request(**fields), [])
    assert caught.value.param == param


def test_an_answer_is_output_items_whole_and_as_stream_events() -> None:
    request = _request(tools=[TOOL])
    skeleton = response_skeleton(request, "resp_abc", 1, "in_progress")
    completion = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}]}
    response, kept = finished(skeleton, completion, EndData("stop", 10, 7, 2))
    assert [i["type"] for i in response["output"]] == ["message", "function_call"]
    assert response["output"][1]["call_id"] == "call_1" and response["status"] == "completed"
    assert response["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 2},
                                 "output_tokens": 7, "output_tokens_details":
                                 {"reasoning_tokens": 0}, "total_tokens": 17}
    assert kept["tool_calls"][0]["id"] == "call_1"

    events = StreamEvents(skeleton)
    text = events.opening() + events.delta({"content": "Let me"}) + events.delta(
        {"content": " check.", "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"city": '}}]}) + events.delta(
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}) + \
        events.closing(response)
    parsed = [json.loads(block.split("data: ", 1)[1]) for block in text.strip().split("\n\n")]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert [p["type"] for p in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert parsed[9]["text"] == "Let me check."
    assert parsed[12]["arguments"] == '{"city": "Paris"}'
    incomplete, _ = finished(skeleton, {"choices": [{"finish_reason": "length", "message": {
        "role": "assistant", "content": "Once"}}]}, EndData("length", 1, 1, 0))
    assert incomplete["status"] == "incomplete" and \
        incomplete["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_store_is_per_tenant_bounded_and_expiring(redis_url) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        try:
            store = ResponseStore(client, ResponsesSettings(max_per_tenant=3, ttl_s=600))
            for i in range(5):
                await store.put("a", StoredResponse({"id": f"resp_{i}"}, [{"role": "user",
                                                                          "content": str(i)}]))
            assert await store.get("a", "resp_0") is None  # the oldest went
            kept = await store.get("a", "resp_4")
            assert kept is not None and kept.messages[0]["content"] == "4"
            assert await client.zcard(keys.responses("a")) == 3
            assert 0 < await client.ttl(keys.response("a", "resp_4")) <= 600
            assert await store.get("b", "resp_4") is None  # another tenant's: not found
            assert await store.get("a", "../x") is None
            assert await store.delete("a", "resp_4") and not await store.delete("a", "resp_4")
        finally:
            await client.aclose()

    run(scenario())


def test_the_document_states_the_responses_routes_with_their_key_and_answers() -> None:
    from types import SimpleNamespace

    from router.api.openapi import DeploymentLimits, openapi_document
    from router.api.routes import build_api
    from router.config import ApiSettings
    from router.telemetry.tracing import OFF

    limits = DeploymentLimits("m", 8, 49152, 2048)
    service = SimpleNamespace(deployment_limits=lambda: limits, metrics=None, api=ApiSettings(),
                              tracing=OFF, known_keys=None, api_keys=None)
    doc = openapi_document(build_api(service), limits)  # type: ignore[arg-type]
    create = doc["paths"]["/v1/responses"]["post"]
    assert create["security"] == [{"bearer": []}]
    assert {"200", "400", "401", "429"} <= set(create["responses"])
    assert create["responses"]["200"]["content"]["application/json"]["schema"]["$ref"] \
        .endswith("/ResponseObject")
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    request = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert request["model"]["enum"] == ["m"]
