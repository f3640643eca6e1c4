"""The Responses API through the real cluster, driven by the official ``openai`` SDK and by
OpenAI's Agents SDK, unmodified: a conversation chained by ``previous_response_id``, streamed
and not; a function call and its output sent back; stored responses read and deleted, and
another tenant's not found; an agent with two Python function tools completes a run (its
model picks and calls the tool; the run ends with the tool's answer, or with the model's own
words after the tool's result)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from router.state.tenants import Tenant
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"]}}


def test_a_conversation_chains_by_previous_response_id_streamed_and_not(
        e2e: E2ECluster) -> None:
    client = e2e.client()
    first = client.responses.create(model=MODEL, input="Which city is the capital of France?",
                                    instructions="Answer in one sentence.", temperature=0,
                                    max_output_tokens=24)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.output_tokens > 0 and first.id.startswith("resp_")
    second = client.responses.create(model=MODEL, input="And of Italy?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=24)
    assert second.output_text and second.previous_response_id == first.id
    # the first turn travelled with it: more prompt than the question alone
    assert second.usage.input_tokens > first.usage.input_tokens
    with client.responses.stream(model=MODEL, input="And of Italy?", temperature=0,
                                 previous_response_id=first.id, max_output_tokens=24) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                             "response.incomplete")
    assert "response.output_text.delta" in kinds
    assert streamed.output_text == second.output_text  # greedy: the same answer
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_function_call_and_its_output_sent_back(e2e: E2ECluster) -> None:
    client = e2e.client()
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                     tools=[WEATHER], tool_choice="required", temperature=0,
                                     max_output_tokens=60)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "18 degrees and sunny"}], temperature=0, max_output_tokens=40)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    with pytest.raises(openai.BadRequestError) as caught:  # an output of no call
        client.responses.create(model=MODEL, input=[
            {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    assert caught.value.body["param"] == "input[0].call_id"


def test_stored_responses_are_the_tenants_own_and_can_be_deleted(e2e: E2ECluster) -> None:
    mine = e2e.client()
    other = e2e.client(e2e.add_tenant(Tenant(id="responses-other")))
    made = mine.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8)
    unstored = mine.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8,
                                     store=False)
    for client, response_id in ((other, made.id), (mine, unstored.id)):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    with pytest.raises(openai.BadRequestError) as caught:  # another tenant's: not found
        other.responses.create(model=MODEL, input="Go on.", previous_response_id=made.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"
    mine.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(made.id)


def _agent(e2e: E2ECluster, calls: list[str], **settings: object) -> object:
    """An agent of OpenAI's Agents SDK on fairserve's Responses API with two Python function
    tools, each recording its call in ``calls``."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # nothing leaves this machine

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(f"weather:{city}")
        return f"18 degrees and sunny in {city}"

    @function_tool
    def get_time(timezone: str) -> str:
        """The current time in a time zone."""
        calls.append(f"time:{timezone}")
        return "12:00"

    behavior = settings.pop("tool_use_behavior", "run_llm_again")
    model = OpenAIResponsesModel(model=MODEL, openai_client=e2e.async_client())
    return Agent(name="assistant", instructions="You answer questions using the tools.",
                 tools=[get_weather, get_time], model=model, tool_use_behavior=behavior,
                 model_settings=ModelSettings(**settings))


def test_an_agent_with_two_function_tools_completes_a_run(e2e: E2ECluster) -> None:
    from agents import Runner

    calls: list[str] = []
    # the tool's answer is the agent's
    agent = _agent(e2e, calls, tool_use_behavior="stop_on_first_tool", tool_choice="required",
                   temperature=0, max_tokens=60)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(calls) == 1 and calls[0].startswith("weather:"), calls
    assert result.final_output == f"18 degrees and sunny in {calls[0].split(':', 1)[1]}"


def test_an_agent_run_ends_in_the_models_own_answer_after_its_tool(e2e: E2ECluster) -> None:
    """The SDK's default loop: a required first call, its result sent back, ``tool_choice``
    reset to auto, and the model answers in its own words (it does not call the tool
    again: fairserve's tools prompt asks for a call only while its result is missing)."""
    from agents import Runner
    from agents.items import MessageOutputItem, ToolCallOutputItem

    calls: list[str] = []
    agent = _agent(e2e, calls, tool_choice="required", temperature=0, max_tokens=60)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(calls) == 1 and calls[0].startswith("weather:"), calls
    kinds = [type(item) for item in result.new_items]
    assert ToolCallOutputItem in kinds and kinds[-1] is MessageOutputItem, kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert "<tool_call>" not in result.final_output
