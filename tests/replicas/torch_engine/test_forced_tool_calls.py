"""``tool_choice: "required"`` on the real engine and model, sampled hot: every answer is a
call that parses and whose arguments validate against its tool's schema (the issue's 100 seeded
samples in the default model's format, 50 more in Hermes'). The prompt, the grammar and the
parser are the router's own (router/api/tools.py, router/api/sampling.py); the engine enforces
the grammar as a replica does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.interface import FinishReason, GenerateRequest
from replicas.engine.sampling_params import GuideKind, SamplingParams, StructuredOutput
from replicas.model_info import describe_model
from replicas.torch_engine.async_engine import TorchEngine
from router.api.openai_models import ChatCompletionRequest
from router.api.prompt_tokenizer import PromptTokenizer
from router.api.sampling import structured_output
from router.api.tools import chat_prompt, parse_calls

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 24},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": -1000,
                                            "maximum": 1000},
                                      "b": {"type": "integer", "minimum": -1000,
                                            "maximum": 1000}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather like in Lisbon?", "What is 17 plus 25?",
             "Should I take an umbrella in Oslo today?", "Add 3 and 4 for me.",
             "How warm is it in Cairo, in fahrenheit?"]
SAMPLES_PER_REQUEST = 10


@pytest.fixture(scope="module")
def engine():
    loop = asyncio.new_event_loop()
    eng = TorchEngine(EngineConfig(max_num_batched_tokens=256, max_num_seqs=16,
                                   max_model_len=2048))
    loop.run_until_complete(eng.start())
    yield loop, eng
    loop.run_until_complete(eng.shutdown())
    loop.close()


def _samples(engine, tokenizer: PromptTokenizer, questions: list[str]) -> list[str]:
    """Each question asked with ``required``, ``SAMPLES_PER_REQUEST`` choices at temperature
    1, every request with its own seed: the answers' texts."""
    loop, eng = engine

    async def ask(i: int, question: str) -> list[str]:
        request = ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": question}],
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
        chat = chat_prompt(request, tokenizer.tool_format, tokenizer.template_takes_tools)
        ids = tokenizer.encode_chat(chat.messages, chat.tools)
        spec = structured_output(request, tokenizer.tool_format)
        assert spec is not None
        params = SamplingParams(max_tokens=96, temperature=1.0, seed=1000 + i,
                                n=SAMPLES_PER_REQUEST, structured_output=StructuredOutput(
                                    GuideKind(spec["kind"]), spec["schema"]))
        texts: dict[int, str] = {}
        async for chunk in eng.generate(GenerateRequest(f"tools-{tokenizer.tool_format}-{i}",
                                                        params, prompt_token_ids=tuple(ids))):
            texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
            if chunk.finish_reason is not None:
                assert chunk.finish_reason is FinishReason.STOP, (question, texts[chunk.index])
        return list(texts.values())

    async def all_of_them() -> list[list[str]]:
        return await asyncio.gather(*(ask(i, q) for i, q in enumerate(questions)))

    return [text for texts in loop.run_until_complete(all_of_them()) for text in texts]


def _check(texts: list[str]) -> set[str]:
    """Every text is exactly one call of a tool with valid arguments; the tools called."""
    called = set()
    for text in texts:
        before, calls = parse_calls(text)
        assert before is None and len(calls) == 1, text
        (call,) = calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        called.add(call.name)
    return called


def test_100_required_samples_are_each_one_valid_call(engine) -> None:
    tokenizer = PromptTokenizer(describe_model(EngineConfig()))
    texts = _samples(engine, tokenizer, (QUESTIONS * 2)[:10])
    assert len(texts) == 100
    assert _check(texts) == set(SCHEMAS)  # hot sampling reaches both tools


def test_50_required_samples_in_hermes_blocks_are_each_one_valid_call(engine) -> None:
    tokenizer = PromptTokenizer(describe_model(EngineConfig(
        chat_template=str(REPO / "tests/fixtures/hermes_chat_template.jinja"))))
    texts = _samples(engine, tokenizer, QUESTIONS)
    assert len(texts) == 50
    assert all(t.startswith("<tool_call>\n{") and t.endswith("}\n</tool_call>") for t in texts)
    _check(texts)
