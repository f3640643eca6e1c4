"""The OpenAI API of the real cluster, driven by the official ``openai`` SDK, unmodified."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.async_engine import TorchEngine
from router.state.tenants import Tenant
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FRANCE = [{"role": "user", "content": "Which city is the capital of France?"}]
STORY_PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[str, int]]:
    """The engine's own greedy output (text, prompt tokens), run in this process."""

    async def go() -> dict[str, tuple[str, int]]:
        engine = TorchEngine(EngineConfig(num_threads=1))
        await engine.start()
        try:
            out = {}
            for name, req in {
                "chat": GenerateRequest("ref-chat", SamplingParams(max_tokens=24, temperature=0),
                                        messages=tuple(FRANCE)),
                "story": GenerateRequest("ref-story", SamplingParams(max_tokens=24, temperature=0),
                                         prompt=STORY_PROMPT),
            }.items():
                chunks = [c async for c in engine.generate(req)]
                assert chunks[-1].usage is not None
                out[name] = ("".join(c.text for c in chunks), chunks[-1].usage.num_prompt_tokens)
            return out
        finally:
            await engine.shutdown()

    return asyncio.run(go())


def test_chat_greedy_equals_the_engine_and_usage_is_right(e2e: E2ECluster, reference) -> None:
    text, prompt_tokens = reference["chat"]
    response = e2e.client().chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24,
                                                    temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert "Paris" in text
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion" and response.model == MODEL
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens >= 1
    assert response.usage.total_tokens == prompt_tokens + response.usage.completion_tokens


def test_chat_stream_matches_the_engine_and_ends_with_usage(e2e: E2ECluster, reference) -> None:
    text, prompt_tokens = reference["chat"]
    stream = e2e.client().chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_streamed_and_not_equal_the_engine(e2e: E2ECluster, reference) -> None:
    text, prompt_tokens = reference["story"]
    client = e2e.client()
    whole = client.completions.create(model=MODEL, prompt=STORY_PROMPT, max_tokens=24,
                                      temperature=0)
    assert whole.object == "text_completion"
    assert whole.choices[0].text == text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == 24
    streamed = client.completions.create(model=MODEL, prompt=STORY_PROMPT, max_tokens=24,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_same_seed_same_sampled_text(e2e: E2ECluster) -> None:
    client = e2e.client()

    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt=STORY_PROMPT, max_tokens=20,
                                      temperature=1.0, top_p=0.95, seed=seed)
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1  # sampling does sample


def test_stop_strings_and_max_tokens(e2e: E2ECluster, reference) -> None:
    text, _ = reference["chat"]
    client = e2e.client()
    stopped = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24,
                                             temperature=0, stop=["Paris"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index("Paris")]
    short = client.chat.completions.create(model=MODEL, messages=FRANCE, max_completion_tokens=3,
                                           temperature=0)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3


def test_logprobs_are_returned_per_token(e2e: E2ECluster) -> None:
    response = e2e.client().chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)  # greedy


def test_models_health_ready(e2e: E2ECluster) -> None:
    assert [m.id for m in e2e.client().models.list()] == [MODEL]
    root = e2e.base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    ready = httpx.get(f"{root}/ready")
    assert ready.status_code == 200 and ready.json()["replicas"] == 2


def test_bad_key_is_401(e2e: E2ECluster) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        e2e.client("fs-not-a-key").chat.completions.create(model=MODEL, messages=FRANCE)
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"


def test_tenant_over_its_quota_gets_429_with_retry_after(e2e: E2ECluster) -> None:
    key = e2e.add_tenant(Tenant(id="quota-rpm", rpm=1))
    client = e2e.client(key)
    client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)
    response = caught.value.response
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert caught.value.body["code"] == "rpm" and caught.value.body["type"] == "rate_limit_error"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "bogus"}, "tool_choice"),
    ({"best_of": 2}, "best_of"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"logit_bias": {"9999999": 5}}, "logit_bias"),
    ({"logit_bias": {"hello": 5}}, "logit_bias"),
    ({"stop_token_ids": [10**8]}, "stop_token_ids"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "string", "pattern": "("}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"temperature": 5}, "temperature"),
    ({"n": 9}, "n"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "gpt-17"}, "model"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
])
def test_an_invalid_field_is_a_4xx_naming_it(e2e: E2ECluster, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": FRANCE, **extra}
    response = httpx.post(f"{e2e.base_url}/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {e2e.demo_key}"})
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert error["param"] == param or error["param"].startswith(f"{param}."), error
    assert error["message"]


def test_a_body_over_the_limit_is_413(e2e: E2ECluster) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2_000_000}]})
    response = httpx.post(f"{e2e.base_url}/chat/completions", content=body,
                          headers={"Authorization": f"Bearer {e2e.demo_key}",
                                   "Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_an_idempotency_key_joins_the_running_request(e2e: E2ECluster) -> None:
    async def go() -> list:
        client = e2e.async_client()
        try:
            calls = [client.chat.completions.create(
                model=MODEL, messages=FRANCE, max_tokens=12, temperature=1.0,
                extra_headers={"Idempotency-Key": "order-42"}) for _ in range(3)]
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    responses = asyncio.run(go())
    assert len({r.id for r in responses}) == 1
    assert len({r.choices[0].message.content for r in responses}) == 1  # one run, not three


def test_openapi_document_describes_the_endpoints(e2e: E2ECluster) -> None:
    doc = httpx.get(e2e.base_url.removesuffix("/v1") + "/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    schema_ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request_schema = doc["components"]["schemas"][schema_ref.rsplit("/", 1)[1]]
    assert {"messages", "model", "max_tokens", "stream_options", "seed", "n", "logit_bias",
            "presence_penalty", "frequency_penalty", "response_format", "ignore_eos", "top_k",
            "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
            "skip_special_tokens", "spaces_between_special_tokens"} <= set(
        request_schema["properties"])
    assert request_schema.get("additionalProperties") is False
    assert {"200", "400", "401", "429"} <= set(chat["responses"])
    assert "/v1/completions" in doc["paths"] and "/v1/models" in doc["paths"]
