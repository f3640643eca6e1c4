"""Bad input is a 400 or 413 in OpenAI's error shape, never a 500, a hang or a harmed engine:
the denial-of-service advisories of peer engines (vLLM's and SGLang's: a huge ``n``,
``min_tokens`` over ``max_tokens``, a prompt over the context, deeply nested JSON, a 10 MB
body, chat-template kwargs), and bodies that are not JSON at all."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HELLO = [{"role": "user", "content": "Hello"}]


def post(e2e: E2ECluster, content: bytes, path: str = "/chat/completions", **headers: str
         ) -> httpx.Response:
    return httpx.post(f"{e2e.base_url}{path}", content=content, timeout=120, headers={
        "Authorization": f"Bearer {e2e.demo_key}", "Content-Type": "application/json",
        **headers})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), [
    ("huge n", {"n": 10**9}, 400, "n", None),
    ("n over the deployment's max_n", {"n": 100}, 400, "n", None),
    ("min_tokens over max_tokens", {"min_tokens": 10**6, "max_tokens": 4}, 400, "min_tokens",
     "min_tokens_over_max_tokens"),
    ("max_tokens of 2**63", {"max_tokens": 2**63}, 400, "max_tokens", None),
    ("prompt over the context", {"messages": [{"role": "user", "content": "hello " * 9000}]},
     400, "messages", "context_length_exceeded"),
    ("top_logprobs huge", {"logprobs": True, "top_logprobs": 10**6}, 400, "top_logprobs", None),
    ("10,000 stop strings", {"stop": ["x"] * 10_000}, 400, "stop", None),
    ("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": True}}, 400,
     "chat_template_kwargs", None),
    ("a chat template of our own", {"chat_template": "{{ ''.__class__.__mro__ }}"}, 400,
     "chat_template", None),
    ("a nested response schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": json.loads('{"items":' * 400 + '{}' + '}' * 400)}}}, 400,
     "response_format", "unsupported_schema"),
    ("a schema nested 40 deep", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": json.loads('{"type":"array","items":' * 40 + '{}'
                                             + '}' * 40)}}}, 400,
     "response_format", "unsupported_schema"),
    ("a 100 KB schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": {"type": "object", "properties": {
            f"field_{i}": {"type": "string", "description": "x" * 90} for i in range(1000)}}}}},
     400, "response_format", "unsupported_schema"),
    ("a 10,000-character stop string", {"stop": ["x" * 10_000]}, 400, "stop", None),
    ("a 900 KB prompt, refused before it is tokenized",
     {"messages": [{"role": "user", "content": "word " * 180_000}]}, 400, "messages",
     "context_length_exceeded"),
])
def test_a_peer_advisory_is_refused_and_names_the_field(e2e: E2ECluster, name: str, body: dict,
                                                        status: int, param: str, code) -> None:
    response = post(e2e, json.dumps({"model": MODEL, "messages": HELLO, **body}).encode())
    assert response.status_code == status, (name, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert error["param"] == param or error["param"].startswith(param), (name, error)
    if code is not None:
        assert error["code"] == code, (name, error)
    if "before it is tokenized" in name:
        assert "characters" in error["message"], error


@pytest.mark.parametrize(("name", "content"), [
    ("not UTF-8", b'{"model": "\xff\xfe", "messages": []}'),
    ("not JSON", b"model=smollm2"),
    ("JSON nested 100,000 deep", nested(100_000).encode()),
    ("a body nested 100,000 deep in a field",
     ('{"model": "m", "messages": ' + nested(100_000) + "}").encode()),
    ("a JSON array", b"[1, 2, 3]"),
    ("empty", b""),
])
def test_a_body_that_is_not_a_request_is_a_400_in_openai_shape(e2e: E2ECluster, name: str,
                                                              content: bytes) -> None:
    response = post(e2e, content)
    assert response.status_code == 400, (name, response.status_code, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], (name, error)


def test_a_10_mb_body_is_a_413_declared_or_streamed(e2e: E2ECluster) -> None:
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 10**7}]})
    declared = post(e2e, big.encode())
    assert declared.status_code == 413, declared.text

    def chunks():  # no Content-Length: the limit holds as the body streams in
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)].encode()

    streamed = httpx.post(f"{e2e.base_url}/chat/completions", content=chunks(), timeout=120,
                          headers={"Authorization": f"Bearer {e2e.demo_key}",
                                   "Content-Type": "application/json"})
    assert streamed.status_code == 413, streamed.text
    for response in (declared, streamed):
        assert response.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_answer_in_openai_shape(e2e: E2ECluster) -> None:
    missing = httpx.get(f"{e2e.base_url}/engines", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.put(f"{e2e.base_url}/chat/completions", timeout=30)
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert wrong.json()["error"]["code"] == "method_not_allowed"


def test_after_the_bad_input_the_engine_serves_and_nothing_is_left(e2e: E2ECluster) -> None:
    leased, loads = asyncio.run(e2e.wait_idle())
    assert leased == 0 and all(x.num_running == 0 for x in loads)
    response = e2e.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens >= 1
