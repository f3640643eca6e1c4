"""Tool calling through the real cluster, driven by the official ``openai`` SDK, unmodified:
a chat loop that calls a tool, sends its result back and gets the answer; ``required`` calls
whose arguments validate against their schema, seeded; the same call streamed (OpenAI's
deltas, as the SDK's own stream helper reassembles them) and whole; bad tool fields named."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 40},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "The time in a time zone",
                                           "parameters": {"type": "object",
                                                          "properties": {"tz": {"type": "string",
                                                                                "maxLength": 30}},
                                                          "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_a_chat_loop_calls_a_tool_sends_its_result_and_gets_the_answer(e2e: E2ECluster) -> None:
    client = e2e.client()
    messages = list(ASK)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": "18 degrees and sunny" if call.function.name == "get_weather"
                         else "12:00"})
    answer = None
    for _ in range(3):  # auto: the model may call again; then it must answer
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               tool_choice="auto", temperature=0, max_tokens=60)
        if reply.choices[0].finish_reason != "tool_calls":
            answer = reply.choices[0].message.content
            break
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "no more data"}
                     for c in reply.choices[0].message.tool_calls]
    if answer is None:
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               tool_choice="none", temperature=0, max_tokens=60)
        answer = reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")
    assert answer  # the loop ends with an answer in text


def test_required_calls_always_validate_seeded_and_name_the_chosen_function(
        e2e: E2ECluster) -> None:
    client = e2e.client()
    for seed in range(12):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=80, parallel_tool_calls=seed % 2 == 0)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls, reply
        assert seed % 2 == 0 or len(calls) == 1  # parallel_tool_calls false: one call
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]


def test_a_streamed_call_reassembles_to_the_whole_one(e2e: E2ECluster) -> None:
    client = e2e.client()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=60)
    with client.beta.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice="required", temperature=0,
                                             max_tokens=60) as stream:
        headers = []
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                for delta in event.chunk.choices[0].delta.tool_calls or []:
                    if delta.id is not None:  # a call's first delta: index, id, type, name
                        assert delta.type == "function" and delta.function.name
                        headers.append(delta.id)
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    got = [(c.id, c.function.name, json.loads(c.function.arguments))
           for c in streamed.choices[0].message.tool_calls]
    want = [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in whole.choices[0].message.tool_calls]
    assert [g[1:] for g in got] == [w[1:] for w in want] and headers == [g[0] for g in got]


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"x": {"type": "nonsense"}}}}}]}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18 C"}]},
     "messages[1].tool_call_id"),
])
def test_bad_tool_fields_are_400s_naming_the_field(e2e: E2ECluster, fields, param) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        e2e.client().chat.completions.create(**body)
    assert caught.value.body["param"] == param, caught.value.body
