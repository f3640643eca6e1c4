"""serveConfigV2 as the chart renders it: Ray's own schema takes it, every import path imports,
its deployment options are what cluster/app.py's build_app sets from the same settings, and the
exact config, deployed on a local Ray here, serves a chat completion through the router."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from cluster.app import build_app
from cluster.ports import free_port
from cluster.redis_server import EmbeddedRedis
from cluster.settings import load_settings
from replicas.protocol import ModelInfo
from tests.helm.chart import PROFILES, REPO, render, serve_config, values_of
from tests.helm.serve_deploy import RESULT


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", PROFILES)
def test_serve_config_parses_with_rays_schema_and_has_no_unknown_keys(name: str) -> None:
    config = serve_config(render(values_of(name)))
    parsed = ServeDeploySchema.model_validate(config)
    # extras are allowed at the top for forward compatibility: make sure there are none
    assert set(config) <= set(ServeDeploySchema.model_fields), set(config)
    for app in config["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields), set(app)
    (app,) = parsed.applications
    assert callable(_import(app.import_path))
    for deployment in config["applications"][0]["deployments"]:
        policy = deployment.get("autoscaling_config", {}).get("policy")
        if policy:
            assert callable(_import(policy["policy_function"]))


def _built_deployments(settings: dict[str, Any]) -> dict[str, Any]:
    """build_app's deployments for ``settings``: name -> Deployment."""
    from ray.serve.deployment import Application

    loaded = load_settings(**settings)
    infos = [ModelInfo(m.name, 2048, 2048, {}) for m in loaded.served_models()]
    app = build_app(loaded, infos, loaded.redis.url or "")
    router = app._bound_deployment
    replicas = [m.replicas._bound_deployment for m in router.init_args[0]]
    assert all(isinstance(m.replicas, Application) for m in router.init_args[0])
    return {router.name: router, **{r.name: r for r in replicas}}


def _same(rendered: Any, built: Any, where: str) -> None:
    if isinstance(rendered, dict):
        for key, value in rendered.items():
            _same(value, built[key] if isinstance(built, dict) else getattr(built, key),
                  f"{where}.{key}")
    elif isinstance(rendered, float | int) and not isinstance(rendered, bool):
        assert float(rendered) == float(built), f"{where}: chart {rendered}, build_app {built}"
    else:
        assert rendered == built, f"{where}: chart {rendered!r}, build_app {built!r}"


@pytest.mark.parametrize("name", PROFILES)
def test_deployment_options_are_what_build_app_sets_from_the_same_settings(name: str) -> None:
    (app,) = serve_config(render(values_of(name)))["applications"]
    built = _built_deployments(app["args"]["settings"])
    assert {d["name"] for d in app["deployments"]} == set(built)  # every model's, no other
    for options in app["deployments"]:
        deployment = built[options["name"]]
        config = deployment._deployment_config
        for key, value in options.items():
            if key == "name":
                continue
            if key == "ray_actor_options":
                _same(value, {k: v for k, v in deployment.ray_actor_options.items()
                              if k != "runtime_env"}, f"{options['name']}.{key}")
            elif key == "autoscaling_config":
                _same(value, config.autoscaling_config.model_dump(), f"{options['name']}.{key}")
            else:
                _same(value, getattr(config, key), f"{options['name']}.{key}")


@pytest.mark.slow
def test_the_rendered_config_deployed_on_local_ray_serves_a_chat_completion(tmp_path) -> None:
    password = "s3cret-for-this-test"
    with EmbeddedRedis(tmp_path / "redis") as redis:
        redis.client().config_set("requirepass", password)
        url = redis.url  # what the config carries: no password in it
        port = free_port()
        values = values_of(
            None, redis={"mode": "external", "external": {"url": url, "existingSecret": "r"}},
            fairserve={"engine": {"num_threads": 1, "max_num_seqs": 8},
                       "replicas": {"num_cpus": 1, "max_ongoing_requests": 8,
                                    "autoscaling": {"min_replicas": 1, "max_replicas": 1}},
                       "router": {"num_replicas": 1, "num_cpus": 0.5}})
        config = serve_config(render(values))
        assert password not in json.dumps(config)
        config["http_options"]["port"] = port  # 8000 may be taken here; nothing else changes
        path = tmp_path / "serve-config.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "FAIRSERVE_REDIS"))}
        done = subprocess.run([sys.executable, "-m", "tests.helm.serve_deploy", str(path), url,
                               password], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
    result = json.loads(line.removeprefix(RESULT))
    assert result["status"].endswith("RUNNING"), result
    assert result["code"] == 200, result
    assert "Paris" in result["body"]["choices"][0]["message"]["content"]


def test_each_model_gets_its_device_its_placement_and_the_default_replicas_it_leaves_out() -> None:
    (app,) = serve_config(render(values_of("models")))["applications"]
    settings = load_settings(**app["args"]["settings"])
    default, second = settings.served_models()
    assert (second.name, second.aliases, second.engine.device) == (
        "SmolLM2-135M-Instruct-bf16", ("precise",), "cpu")
    assert dict(second.replicas.resources) == {"fairserve_model": 1}
    assert second.replicas.autoscaling.allow_scale_to_zero  # its own
    assert second.replicas.max_ongoing_requests == default.replicas.max_ongoing_requests
    names = [d["name"] for d in app["deployments"]]
    assert names == ["Router", "ModelReplica", "ModelReplica-SmolLM2-135M-Instruct-bf16"]
