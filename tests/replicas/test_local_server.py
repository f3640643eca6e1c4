"""The minimal local endpoint that ``fairserve up`` serves, over the real engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from replicas.engine.async_engine import TorchEngine
from replicas.engine.config import EngineConfig
from replicas.local_server import build_app

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client():
    engine = TorchEngine(EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))
    asyncio.run(engine.start())
    with TestClient(build_app(engine, "smol")) as c:
        yield c
    asyncio.run(engine.shutdown())


def test_chat_completion(client) -> None:
    r = client.post("/v1/chat/completions", json={"model": "smol", "messages": QUESTION, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] > 0


def test_streamed_completion_matches_unstreamed(client) -> None:
    payload = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/completions", json=payload).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=payload | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == plain
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_fields_get_openai_errors(client) -> None:
    r = client.post("/v1/chat/completions", json={"model": "smol", "messages": QUESTION, "temperature": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = client.post("/v1/chat/completions", json={"model": "smol", "messages": QUESTION, "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


def test_max_tokens_zero_and_non_object_bodies_are_refused(client) -> None:
    r = client.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json=["not", "an", "object"])
    assert r.status_code == 400
    r = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
