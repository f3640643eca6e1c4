"""The settings tree: YAML file, FAIRSERVE_* environment (stronger), unknown keys refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.settings import load_settings


def test_defaults_serve_the_default_model_on_cpu() -> None:
    s = load_settings()
    assert s.engine.model.endswith(".gguf") and s.engine.device == "cpu"
    assert s.replicas.num_replicas == 1 and s.replicas.num_gpus == 0
    assert s.router.port == 8000 and s.redis.url is None and s.ray.address is None


def test_yaml_file_then_environment_overrides_it(tmp_path, monkeypatch) -> None:
    config = tmp_path / "fairserve.yaml"
    config.write_text("replicas: {num_replicas: 3, num_cpus: 0.5}\n"
                      "router: {port: 9000, dispatch: {poll_s: 0.5}}\n"
                      "engine: {num_threads: 1}\n")
    s = load_settings(config)
    assert (s.replicas.num_replicas, s.replicas.num_cpus, s.router.port) == (3, 0.5, 9000)
    assert s.router.dispatch.poll_s == 0.5 and s.engine.num_threads == 1
    monkeypatch.setenv("FAIRSERVE_REPLICAS__NUM_REPLICAS", "2")
    monkeypatch.setenv("FAIRSERVE_REDIS__URL", "redis://elsewhere:6379/0")
    s = load_settings(config)
    assert s.replicas.num_replicas == 2 and s.replicas.num_cpus == 0.5
    assert s.redis.url == "redis://elsewhere:6379/0"
    assert load_settings(config, router={"port": 7000}).router.port == 7000


@pytest.mark.parametrize("yaml_text, field", [
    ("replicas: {num_replica: 2}\n", "num_replica"),
    ("router: {port: 0}\n", "port"),
    ("queues: {lease_ms: 5}\n", "lease_ms"),
    ("colour: blue\n", "colour"),
])
def test_a_bad_setting_is_an_error_naming_it(tmp_path, yaml_text: str, field: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ValidationError) as caught:
        load_settings(config)
    assert field in str(caught.value)


def test_slots_beyond_the_engine_batch_are_refused() -> None:
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        load_settings(replicas={"max_ongoing_requests": 128}, engine={"max_num_seqs": 64})


def test_a_missing_settings_file_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_settings(tmp_path / "nope.yaml")
