"""The settings tree: YAML file, FAIRSERVE_* environment (stronger), unknown keys refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.settings import load_settings


def test_defaults_serve_the_default_model_on_cpu() -> None:
    s = load_settings()
    # device auto: cpu where no GPU is visible (replicas/torch_engine/device_choice.py)
    assert s.engine.model.endswith(".gguf") and s.engine.device == "auto"
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


def test_a_router_drain_shorter_than_the_replicas_stop_is_refused() -> None:
    """A redeploy replaces routers and replicas at once: a router that stops before the old
    replicas are gone cuts its clients' streams (tests/chaos/test_drain.py)."""
    with pytest.raises(ValidationError, match=r"router.graceful_shutdown_timeout_s \(30.0\)"):
        load_settings(replicas={"graceful_shutdown_timeout_s": 30},
                      router={"graceful_shutdown_timeout_s": 30})
    settings = load_settings(replicas={"graceful_shutdown_timeout_s": 30},
                             router={"graceful_shutdown_timeout_s": 35.5})
    assert settings.router.graceful_shutdown_timeout_s == 35.5


def test_a_missing_settings_file_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_settings(tmp_path / "nope.yaml")


def test_every_path_is_absolute_relative_paths_against_the_current_directory(
        tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAIRSERVE_TENANTS__FILE", "conf/tenants.yaml")
    monkeypatch.setenv("FAIRSERVE_CACHE_DIR", "cache")  # the default cache dir's root
    s = load_settings(engine={"model": "models/m.gguf"})
    assert s.state_dir == tmp_path / ".fairserve"  # the default, made absolute
    assert s.tenants.file == tmp_path / "conf" / "tenants.yaml"
    assert s.engine.model == str(tmp_path / "models" / "m.gguf")
    assert s.engine.model_cache_dir == str(tmp_path / "cache" / "models")
    assert load_settings(state_dir="~/state").state_dir.is_absolute()
    assert load_settings(engine={"model_cache_dir": ""}).engine.model_cache_dir is None


def test_paths_in_a_settings_file_are_relative_to_that_file(tmp_path, monkeypatch) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "fairserve.yaml").write_text(
        "state_dir: ../state\ntenants: {file: tenants.yaml}\n"
        "engine: {model: models/m.gguf, model_cache_dir: /abs/cache}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    s = load_settings("../conf/fairserve.yaml")
    assert s.state_dir == tmp_path / "state"
    assert s.tenants.file == conf / "tenants.yaml"
    assert s.engine.model == str(conf / "models" / "m.gguf")
    assert s.engine.model_cache_dir == "/abs/cache"
    # a flag or an environment variable is still read against the current directory
    monkeypatch.setenv("FAIRSERVE_STATE_DIR", "here")
    assert load_settings("../conf/fairserve.yaml").state_dir == elsewhere / "here"


def test_the_redis_password_joins_the_url_and_never_shows(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "password").write_text("s3cret\n")
    s = load_settings(redis={"url": "redis://queues:6379/0", "password_file": "password"})
    assert s.redis.password_file == tmp_path / "password"  # a local path like any other
    assert s.redis.url_with_password() == "redis://:s3cret@queues:6379/0"
    monkeypatch.setenv("FAIRSERVE_REDIS__PASSWORD", "from-env")
    s = load_settings(redis={"url": "redis://queues:6379/0"})
    assert s.redis.url_with_password() == "redis://:from-env@queues:6379/0"
    assert "from-env" not in repr(s) and "from-env" not in s.model_dump_json()


def test_a_lease_shorter_than_three_renewals_is_refused() -> None:
    """Renewed every 3 s, a 3 s lease lapses whenever a renewal is late: busy routers lost
    their requests mid-stream (tests/chaos/test_many_routers.py found it)."""
    with pytest.raises(ValidationError, match=r"router.dispatch.renew_s \(3\).*at most 1\b"):
        load_settings(queues={"lease_ms": 3000})
    settings = load_settings(queues={"lease_ms": 3000}, router={"dispatch": {"renew_s": 1}})
    assert settings.router.dispatch.renew_s == 1
