"""The fields the clients people use send, through the official ``openai`` SDK against the real
cluster: penalties, ``n``, ``logit_bias``, JSON output, and vLLM's extensions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.async_engine import TorchEngine
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FRANCE = [{"role": "user", "content": "Which city is the capital of France?"}]
COUNT = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.2}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                            "maximum": 120}}},
    "weather": {
        "type": "object", "additionalProperties": False,
        "required": ["city", "unit", "temperatures"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                       "unit": {"type": "string", "enum": ["C", "F"]},
                       "temperatures": {"type": "array", "items": {"type": "number"},
                                        "minItems": 1, "maxItems": 4}}},
    "todo": {
        "type": "object", "additionalProperties": False, "required": ["title", "done", "tags"],
        "properties": {"title": {"type": "string", "maxLength": 40}, "done": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    },
}
ASKS = {"person": "Give me a person as JSON.", "weather": "Report the weather in Paris as JSON.",
        "todo": "Write one to-do item as JSON."}


@pytest.fixture(scope="module")
def engine_reference() -> dict[str, str]:
    """The engine's own greedy text for the same requests, run in this process."""

    async def go() -> dict[str, str]:
        engine = TorchEngine(EngineConfig(num_threads=1))
        await engine.start()
        try:
            out = {}
            for name, extra in (("plain", {}), ("penalised", PENALTIES)):
                params = SamplingParams(max_tokens=40, temperature=0.0, **extra)
                request = GenerateRequest(f"ref-{name}", params, messages=tuple(COUNT))
                out[name] = "".join([c.text async for c in engine.generate(request)])
            return out
        finally:
            await engine.shutdown()

    return asyncio.run(go())


def test_penalties_change_the_output_and_equal_the_engine(e2e: E2ECluster,
                                                         engine_reference) -> None:
    client = e2e.client()
    plain = client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=40,
                                           temperature=0)
    penalised = client.chat.completions.create(
        model=MODEL, messages=COUNT, max_tokens=40, temperature=0,
        frequency_penalty=PENALTIES["frequency_penalty"],
        presence_penalty=PENALTIES["presence_penalty"],
        extra_body={"repetition_penalty": PENALTIES["repetition_penalty"]})
    assert plain.choices[0].message.content == engine_reference["plain"]
    assert penalised.choices[0].message.content == engine_reference["penalised"]
    assert engine_reference["plain"] != engine_reference["penalised"]


def test_n_3_returns_3_choices_greedy_equal_and_usage_counted_per_choice(e2e: E2ECluster) -> None:
    client = e2e.client()
    response = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=8, temperature=0, n=3,
        extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) == 1
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 3 * 8  # each choice's tokens, counted once
    single = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8,
                                            temperature=0)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once


def test_seeded_n_is_reproducible_and_its_choices_differ(e2e: E2ECluster) -> None:
    client = e2e.client()

    def texts() -> list[str]:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=16, temperature=1.0, seed=11, n=3)
        return [c.message.content or "" for c in response.choices]

    first = texts()
    assert texts() == first and len(set(first)) == 3


def test_n_2_streams_interleaved_by_index_each_with_its_finish(e2e: E2ECluster) -> None:
    stream = e2e.client().chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=10, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True})
    content: dict[int, str] = {0: "", 1: ""}
    roles, finishes, usage = set(), {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            content[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1} and set(finishes) == {0, 1}
    assert content[0] == content[1] and "Paris" in content[0]
    assert usage is not None and usage.completion_tokens > 0


def test_logit_bias_minus_100_bans_a_token(e2e: E2ECluster) -> None:
    from router.api.prompt_tokenizer import PromptTokenizer

    client = e2e.client()
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,
                                           temperature=0).choices[0].message.content
    assert "Paris" in (plain or "")
    tokenizer = PromptTokenizer(e2e.model_info)
    paris = tokenizer.encode(" Paris")[-1]
    banned = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,
                                            temperature=0, logit_bias={str(paris): -100})
    assert " Paris" not in (banned.choices[0].message.content or "")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_parses_and_validates(e2e: E2ECluster, name: str,
                                                 stream: bool) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                  "strict": True}}
    messages = [{"role": "user", "content": ASKS[name]}]
    client = e2e.client()
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                                temperature=0.7, seed=5, response_format=fmt,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        response = client.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=120, temperature=0.7, seed=5,
                                                  response_format=fmt)
        assert response.choices[0].finish_reason == "stop"
        text = response.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_completions_response_format(e2e: E2ECluster) -> None:
    client = e2e.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{
        "role": "user", "content": "Return a JSON object with the name and color of a cat."}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    completion = client.completions.create(
        model=MODEL, prompt="A JSON object describing a dog:", max_tokens=80, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "dog", "schema": SCHEMAS["person"]}}})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS["person"])


def test_continuous_usage_stats_put_the_usage_on_every_chunk(e2e: E2ECluster) -> None:
    stream = e2e.client().completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    counts = [chunk.usage.completion_tokens for chunk in stream]
    assert counts == sorted(counts) and counts[-1] == 12  # ignore_eos: exactly max_tokens


def test_vllm_stop_extensions(e2e: E2ECluster) -> None:
    client = e2e.client()
    kept = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=20, temperature=0, stop=["Paris"],
        extra_body={"include_stop_str_in_output": True})
    assert (kept.choices[0].message.content or "").endswith("Paris")
    from router.api.prompt_tokenizer import PromptTokenizer

    comma = PromptTokenizer(e2e.model_info).encode(",")[-1]
    stopped = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6,
                                        temperature=0, extra_body={"stop_token_ids": [comma]})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and "," not in choice.text
    assert 1 <= stopped.usage.completion_tokens < 6
