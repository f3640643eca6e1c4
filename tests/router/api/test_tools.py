"""Tool calling in chat (router/api/tools.py): the request's checks, the prompt, the parser
(whole and streamed, however the text is cut), and what the shaper makes of it: OpenAI's
``tool_calls``, ``finish_reason: "tool_calls"``, deltas that reassemble to the same calls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from replicas.engine.config import EngineConfig
from replicas.model_info import describe_model
from replicas.protocol import MAX_FORCED_CALLS, GrammarError, check_grammar, grammar_for
from router.api.error_handlers import describe_validation_error
from router.api.openai_models import ChatCompletionRequest
from router.api.prompt_tokenizer import PromptTokenizer
from router.api.shaper import Shape, Shaper
from router.api.tools import (
    CLOSE,
    OPEN,
    RESULTS_NOTE,
    StreamingCalls,
    ToolFormat,
    calls_schema,
    chat_prompt,
    check_references,
    parse_calls,
    tool_format,
)
from router.dispatch.response_events import ChunkData, EndData
from router.errors import TOOL_REFERENCE, InvalidRequestError
from router.telemetry.request_observer import PhaseTimes

REPO = Path(__file__).resolve().parents[3]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
CALLS = (f'{OPEN}[{{"name": "get_weather", "arguments": {{"city": "Paris \\"Île\\"", "n": '
         f'[1, {{"a": "}}]"}}]}}}}, {{"name": "get_time", "arguments": {{}}}}]{CLOSE}')


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
         "tools": [WEATHER, TIME], **fields})


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        "content": "x"}]}, "tool_calls"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_fields_are_refused_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _request(**fields)
    _, named = describe_validation_error(caught.value.errors())
    assert named == param


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]},
     "messages[1].tool_call_id"),
])
def test_what_refers_to_nothing_is_refused_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_references(_request(**fields))
    assert (caught.value.param, caught.value.code) == (param, TOOL_REFERENCE)


def test_a_schema_that_cannot_compile_is_a_grammar_error() -> None:
    request = _request(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}])
    with pytest.raises(GrammarError):
        check_grammar("tool_calls", json.dumps(calls_schema(request.tools, "required", True)))


def test_the_prompt_lists_the_tools_and_renders_past_calls_and_results() -> None:
    request = _request(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    messages = chat_prompt(request).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "system"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"get_time"' in \
        messages[0]["content"]
    assert messages[2]["content"] == \
        f'{OPEN}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]{CLOSE}'
    assert chat_prompt(_request(tool_choice="none")).messages[0]["role"] == "user"
    # under auto, results that end the conversation are followed by the note asking for the
    # answer (the 135M default model called the same function again after every result)
    assert messages[-1] == {"role": "system", "content": RESULTS_NOTE}
    assert chat_prompt(request.model_copy(update={"tool_choice": "required"})).messages[-1][
        "role"] == "tool"
    # in Hermes' format (a model whose template does not render tools itself)
    hermes = chat_prompt(request, ToolFormat.HERMES).messages
    assert hermes[2]["content"] == \
        f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    assert f'{OPEN}\n{{"name": "function_name"' in hermes[0]["content"]


def test_the_format_follows_the_parser_setting_and_the_template() -> None:
    template = (REPO / "tests/fixtures/hermes_chat_template.jinja").read_text()
    assert tool_format("auto", template) is ToolFormat.HERMES
    assert tool_format("auto", "{{ messages }}") is ToolFormat.FAIRSERVE  # no tools in it
    assert tool_format("auto", None) is ToolFormat.FAIRSERVE
    assert tool_format("fairserve", template) is ToolFormat.FAIRSERVE
    assert tool_format("hermes", None) is ToolFormat.HERMES


@pytest.fixture(scope="module")
def hermes_tokenizer() -> PromptTokenizer:
    """The default model's tokenizer with a template in Qwen 2.5's layout
    (engine.chat_template)."""
    info = describe_model(EngineConfig(
        chat_template=str(REPO / "tests/fixtures/hermes_chat_template.jinja")))
    return PromptTokenizer(info)


def test_a_template_that_takes_tools_renders_them_the_calls_and_the_results(
        hermes_tokenizer: PromptTokenizer) -> None:
    tokenizer = hermes_tokenizer
    assert tokenizer.tool_format is ToolFormat.HERMES and tokenizer.template_takes_tools
    request = _request(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    chat = chat_prompt(request, tokenizer.tool_format, tokenizer.template_takes_tools)
    text = tokenizer._hf.decode(tokenizer.encode_chat(chat.messages, chat.tools))
    assert "<tools>\n" + json.dumps(WEATHER) in text  # the template's own tools section
    assert "You have access to the following functions" not in text  # not fairserve's
    assert (f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
            in text)
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = chat_prompt(_request(tool_choice="none"), tokenizer.tool_format, True)
    assert plain.tools is None
    assert "<tools>" not in tokenizer._hf.decode(tokenizer.encode_chat(plain.messages))


def test_a_forced_call_in_hermes_blocks_compiles_and_is_refused_when_the_schema_cannot() -> None:
    request = _request(tool_choice="required")
    schema = json.dumps(calls_schema(request.tools, "required", True))
    check_grammar("tool_call_blocks", schema)
    grammar = grammar_for("tool_call_blocks", schema)
    assert grammar.count('("\\n" block)?') == MAX_FORCED_CALLS - 1
    one = json.dumps(calls_schema(request.tools, "required", False))
    assert '("\\n" block)?' not in grammar_for("tool_call_blocks", one)
    bad = _request(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}])
    with pytest.raises(GrammarError):
        check_grammar("tool_call_blocks", json.dumps(calls_schema(bad.tools, "required", True)))


def test_a_whole_answer_parses_into_calls_or_stays_text() -> None:
    before, calls = parse_calls("Let me check." + CALLS)
    assert before == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris "Île"', "n": [1, {"a": "}]"}]}), ("get_time", {})]
    hermes = f'{OPEN}\n{{"name": "get_time", "arguments": {{"tz": "UTC"}}}}\n{CLOSE}'
    assert parse_calls(hermes + "\n" + hermes)[1][1].name == "get_time"  # a block per call
    for text in ("Paris is sunny.", f"{OPEN}[{{not json}}]{CLOSE}", f"{OPEN}[{{\"x\": 1}}]",
                 f'{OPEN}[{{"name": "f"'):
        assert parse_calls(text) == (text, [])


def _streamed(text: str, forced: bool, cuts: list[int]) -> tuple[str, dict[int, tuple]]:
    calls = StreamingCalls("req-1", 0, forced)
    content, seen, start = "", {}, 0
    for cut in [*cuts, len(text)]:
        deltas = calls.feed(text[start:cut])
        start = cut
        content += deltas.content
        for entry in deltas.tool_calls:
            name, args = seen.get(entry["index"], (None, ""))
            if "id" in entry:
                assert name is None, "a call's header comes once, first"
                name = entry["function"]["name"]
            assert name is not None, "arguments come after the header"
            seen[entry["index"]] = (name, args + entry["function"]["arguments"])
    content += calls.finish().content
    return content, {i: (n, json.loads(a)) for i, (n, a) in seen.items()}


@pytest.mark.parametrize("forced", [True, False])
def test_streamed_calls_are_the_whole_answers_calls_however_the_text_is_cut(forced) -> None:
    text = ("" if forced else "Let me check.") + CALLS
    _, expected = parse_calls(text)
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 20)))
        content, calls = _streamed(text, forced, cuts)
        assert content == ("" if forced else "Let me check.")
        assert calls == {i: (c.name, json.loads(c.arguments)) for i, c in enumerate(expected)}
    # Hermes' blocks, one call object each, read the same
    blocks = "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)})}"
                       f"\n{CLOSE}" for c in expected)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(blocks)), rng.randint(0, 20)))
        prefix = "" if forced else "Let me check."
        content, calls = _streamed(prefix + blocks, forced, [c + len(prefix) for c in cuts])
        assert content == prefix
        assert calls == {i: (c.name, json.loads(c.arguments)) for i, c in enumerate(expected)}
    # a string may hold anything, the closing tag too (a forced call sampled at temperature 1
    # wrote one into a "notes" argument): the block ends where its brackets close
    tricky = f'{OPEN}[{{"name": "get_time", "arguments": {{"tz": "a}}]{CLOSE} b"}}}}]{CLOSE}'
    assert parse_calls(tricky)[1][0].arguments == json.dumps({"tz": f"a}}]{CLOSE} b"})
    for cuts in ([], [3, 30, 31], list(range(1, len(tricky)))):
        for mode in (True, False):
            assert _streamed(tricky, mode, cuts) == ("", {0: ("get_time", {"tz": f"a}}]{CLOSE} b"})})
    # not forced, a block that does not parse is text; a tag cut in two is held, then sent
    assert _streamed(f"a {OPEN}[oops]{CLOSE}", False, [3, 9]) == (f"a {OPEN}[oops]{CLOSE}", {})
    assert _streamed("x <tool", False, [4]) == ("x <tool", {})


def test_the_shaper_answers_with_tool_calls_whole_and_streamed() -> None:
    shape = Shape("chatcmpl-1", True, "m", 1, 10, tool_mode="forced")
    end = EndData("stop", 10, 30, 0)
    whole = Shaper(shape, str)
    whole.add(ChunkData(CALLS, 30, None, 0, "stop"))
    message = whole.final(end, PhaseTimes(0.0, 0.0, 0.0, 0.0))["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] is None
    ids = [c["id"] for c in message["message"]["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)

    streamed, deltas, finish = Shaper(shape, str), [], None
    pieces = [CALLS[i:i + 5] for i in range(0, len(CALLS), 5)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        payload = streamed.delta(ChunkData(piece, 1, None, 0, "stop" if last else None))
        if payload is not None:
            choice = payload["choices"][0]
            deltas += choice["delta"].get("tool_calls", [])
            finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    assert [d["id"] for d in deltas if "id" in d] == ids  # the same ids, whole or streamed
    args = {}
    for d in deltas:
        args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert [json.loads(a) for a in args.values()] == [
        json.loads(c["function"]["arguments"]) for c in message["message"]["tool_calls"]]


@pytest.mark.parametrize("fields, expected", [
    ({}, {"fairserve.tools.count": 2, "fairserve.tool_choice": "auto"}),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     {"fairserve.tools.count": 2, "fairserve.tool_choice": "function:get_time"}),
    ({"tools": None}, {}),
])
def test_the_request_span_names_the_tools_and_the_choice(fields: dict, expected: dict) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router.telemetry.metrics import MetricsStore
    from router.telemetry.request_observer import RequestObserver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("request"):
        RequestObserver(MetricsStore(), _request(**fields))
    (span,) = exporter.get_finished_spans()
    tools = {k: v for k, v in span.attributes.items() if k.startswith("fairserve.tool")}
    assert tools == expected
