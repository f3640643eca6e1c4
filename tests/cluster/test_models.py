"""Two base models behind one endpoint: ``fairserve up`` with the shipped example
(``deploy/examples/models.yaml``: the default model, and the same weights unquantized as a
second model with its own deployment), run as a user runs it.

The request's ``model`` (a served name or an alias) picks the model, and only that model's
replica steps; ``GET /v1/models`` lists the models, their aliases and their context; a tenant
whose allow-list names the second model alone gets 404 ``model_not_found`` for the first and
may use the second by its alias; an adapter added for the second model (``--base``) runs on
it. A flood on the first model waits in the first model's queue while a request to the second
is served (it finishes while the flood still has requests queued)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from replicas.engine.config import default_model_path
from replicas.torch_engine.loader import load_model_source
from replicas.torch_engine.lora import write_random_adapter
from router.state import keys
from router.state.capacity import read_loads
from router.state.redis_client import connect
from tests.cluster.factories import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "deploy" / "examples" / "models.yaml"
DEFAULT, SECOND = "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-bf16"
FLOOD = 24


def _chat(base: str, key: str, model: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{base}/chat/completions", timeout=300,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True,
                            "messages": [{"role": "user", "content": "Tell me about tides."}]})


def _models(base: str, key: str) -> dict[str, dict]:
    reply = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return {m["id"]: m for m in reply.json()["data"]}


async def _steps(redis_url: str) -> dict[str, int]:
    client = connect(redis_url)
    try:
        return {load.model: load.num_steps for load in await read_loads(client)}
    finally:
        await client.aclose()


def _stepped(redis_url: str, before: dict[str, int], model: str) -> dict[str, int]:
    """The replicas' engine steps, once a load report (every 0.5 s) shows ``model`` has
    stepped since ``before``, and then one more report (so every replica's is current)."""
    for _ in range(100):
        now = asyncio.run(_steps(redis_url))
        if now[model] > before[model]:
            time.sleep(0.6)
            return asyncio.run(_steps(redis_url))
        time.sleep(0.1)
    raise AssertionError(f"{model} reported no step since {before}")


async def _queued(redis_url: str, tenant: str) -> int:
    client = connect(redis_url)
    try:
        return int(await client.llen(keys.queue(tenant)))
    finally:
        await client.aclose()


async def _flood_then_second(base: str, flood_key: str, quiet_key: str, redis_url: str
                             ) -> tuple[int, int]:
    """The flood on the default model, then, once it queues, one request to the second
    model; returns the flood's queued requests when that one finished, and its status."""
    async with httpx.AsyncClient(timeout=600) as client:
        def chat(key: str, model: str, max_tokens: int) -> object:
            return client.post(f"{base}/chat/completions",
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": model, "max_tokens": max_tokens,
                                     "ignore_eos": True, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Go on."}]})

        flood = [asyncio.create_task(chat(flood_key, DEFAULT, 48)) for _ in range(FLOOD)]
        for _ in range(600):
            if await _queued(redis_url, "flood") > 0:
                break
            await asyncio.sleep(0.05)
        reply = await chat(quiet_key, "precise", 8)
        waiting = await _queued(redis_url, "flood")
        assert all(r.status_code == 200 for r in await asyncio.gather(*flood))
        return waiting, reply.status_code


def test_two_models_behind_one_endpoint_each_with_its_queues_names_and_adapters(
        tmp_path) -> None:
    adapter = write_random_adapter(tmp_path / "tone", load_model_source(default_model_path()).config,
                                   8, 3)
    # the default model's replica takes 4 at once: the flood below has to queue
    up = UpProcess(tmp_path, "--config", str(EXAMPLE),
                   env={"FAIRSERVE_REPLICAS__MAX_ONGOING_REQUESTS": "4"})
    try:
        out = up.wait_ready()
        assert "API key:" in out, out
        run_state = json.loads((tmp_path / "run.json").read_text())
        base, redis_url = run_state["base_url"], run_state["redis_url"]
        demo = (tmp_path / "demo-key").read_text().strip()
        redis_args = ["--redis-url", redis_url]

        cards = _models(base, demo)
        assert set(cards) == {DEFAULT, "fast", SECOND, "precise"}
        assert cards["precise"]["root"] == SECOND and cards["fast"]["root"] == DEFAULT
        assert all(card["max_model_len"] > 0 for card in cards.values())

        # each name reaches its own model's replica, and only that one steps
        before = asyncio.run(_steps(redis_url))
        assert set(before) == {DEFAULT, SECOND}, before
        for model in (SECOND, "precise"):
            reply = _chat(base, demo, model)
            assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
        after = _stepped(redis_url, before, SECOND)
        assert after[DEFAULT] == before[DEFAULT], (before, after)
        assert _chat(base, demo, "fast").status_code == 200
        assert _stepped(redis_url, after, DEFAULT)[SECOND] == after[SECOND]

        # a tenant allowed the second model alone
        assert up.cli("tenants", "add", "beta", "--models", SECOND, *redis_args).returncode == 0
        beta = up.cli("tenants", "key-create", "beta", *redis_args).stdout.strip()
        assert set(_models(base, beta)) == {SECOND, "precise"}
        refused = _chat(base, beta, DEFAULT)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == \
            "model_not_found", refused.text
        assert _chat(base, beta, "precise").status_code == 200  # its alias: the model allowed

        # an adapter of the second model runs on the second model's replicas
        added = up.cli("adapters", "add", "tone", str(adapter), "--base", SECOND, *redis_args)
        assert added.returncode == 0, added.stderr
        assert _models(base, demo)["tone"]["root"] == SECOND
        steps = asyncio.run(_steps(redis_url))
        toned = _chat(base, demo, "tone", 16)
        assert toned.status_code == 200, toned.text
        assert _stepped(redis_url, steps, SECOND)[DEFAULT] == steps[DEFAULT]
        plain = _chat(base, demo, SECOND, 16).json()["choices"][0]["message"]["content"]
        assert toned.json()["choices"][0]["message"]["content"] != plain

        # a flood on the default model does not hold up the second
        assert up.cli("tenants", "add", "flood", *redis_args).returncode == 0
        flood_key = up.cli("tenants", "key-create", "flood", *redis_args).stdout.strip()
        waiting, status = asyncio.run(_flood_then_second(base, flood_key, demo, redis_url))
        assert status == 200
        assert waiting > 0, "the second model's request waited for the flood's queue"
        status_out = up.cli("status", "--state-dir", str(tmp_path)).stdout
        assert f"models: {DEFAULT} (1 replica(s)), {SECOND} (1 replica(s))" in status_out
    finally:
        up.stop()
