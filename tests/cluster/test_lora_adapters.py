"""LoRA adapters through the whole cluster: ``fairserve up`` with an adapter in its settings
(``engine.lora_adapters``) and one added at run time for one tenant (``fairserve adapters
add``), both built by the test (random weights in PEFT's format) on the default model.

A request names an adapter as its ``model``; the replica loads it on first use. The text equals
the engine's own with that adapter (the same settings, in this process), and differs from the
base model's; ``GET /v1/models`` lists what each tenant may use with the context length;
another tenant's private adapter is the 404 ``model_not_found`` of a name that does not exist;
``fairserve status`` shows the adapters a replica holds."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from replicas.engine.config import EngineConfig, default_model_path
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.engine_core import EngineCore
from replicas.torch_engine.loader import load_model_source
from replicas.torch_engine.lora import write_random_adapter
from tests.cluster.factories import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BASE = "SmolLM2-135M-Instruct"
PROMPT = "Write a short story about a lighthouse."
MAX_TOKENS = 16


def _engine_text(engine: EngineCore, adapter: str | None) -> str:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    engine.add(engine.prepare(GenerateRequest(
        f"ref-{adapter}", SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                         ignore_eos=True),
        prompt_token_ids=tuple(ids), adapter=adapter)))
    text = ""
    while engine.has_unfinished:
        text += "".join(chunk.text for chunk in engine.step())
    return text


def test_adapters_are_models_of_their_own_private_where_added_so(tmp_path) -> None:
    source = load_model_source(default_model_path())
    public = write_random_adapter(tmp_path / "tone", source.config, 8, 1)
    private = write_random_adapter(tmp_path / "acme", source.config, 4, 2)
    config = tmp_path / "fairserve.yaml"
    config.write_text(yaml.safe_dump({"engine": {"lora_adapters": {"tone": str(public)}}}))
    up = UpProcess(tmp_path, "--config", str(config))
    try:
        out = up.wait_ready()
        assert "API key:" in out, out
        base = json.loads((tmp_path / "run.json").read_text())["base_url"]
        demo = (tmp_path / "demo-key").read_text().strip()
        redis_url = ["--redis-url", json.loads((tmp_path / "run.json").read_text())["redis_url"]]
        assert up.cli("tenants", "add", "beta", *redis_url).returncode == 0
        beta = up.cli("tenants", "key-create", "beta", *redis_url).stdout.strip()
        added = up.cli("adapters", "add", "demo-private", str(private), "--tenant", "demo",
                       *redis_url)
        assert added.returncode == 0, added.stderr
        listed = up.cli("adapters", "list", *redis_url).stdout
        assert "demo-private" in listed and str(private) in listed

        def chat(key: str, model: str) -> httpx.Response:
            return httpx.post(f"{base}/chat/completions", timeout=300,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                                    "ignore_eos": True,
                                    "messages": [{"role": "user", "content": PROMPT}]})

        def models(key: str) -> dict[str, dict]:
            reply = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
            return {m["id"]: m for m in reply.json()["data"]}

        assert set(models(demo)) == {BASE, "tone", "demo-private"}
        assert set(models(beta)) == {BASE, "tone"}
        card = models(demo)["tone"]
        assert card["parent"] == card["root"] == BASE and card["max_model_len"] > 0

        texts = {}
        for model in (BASE, "tone", "demo-private"):
            reply = chat(demo, model)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == model
            texts[model] = reply.json()["choices"][0]["message"]["content"]
        assert len(set(texts.values())) == 3, texts  # each adapter changes the text
        refused = chat(beta, "demo-private")
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert refused.json()["error"]["param"] == "model"
        assert chat(beta, "tone").json()["choices"][0]["message"]["content"] == texts["tone"]

        # the engine alone, with the replica's settings, gives the same texts
        engine = EngineCore(EngineConfig(num_threads=1, lora_adapters={"tone": str(public),
                                                                       "demo-private":
                                                                       str(private)}),
                            source=source)
        for model in ("tone", "demo-private"):
            assert _engine_text(engine, model) == texts[model], model

        status = up.cli("status", "--state-dir", str(tmp_path))
        assert "adapters: " in status.stdout and "tone" in status.stdout, status.stdout
        assert up.cli("adapters", "remove", "demo-private", *redis_url).returncode == 0
        assert chat(demo, "demo-private").status_code == 404
    finally:
        up.stop()
