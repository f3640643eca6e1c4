"""Builds the Ray Serve application from the settings tree: a model replica deployment per
served model (the default one is ``ModelReplica``, another ``ModelReplica-<its name>``) and
the router ingress deployment bound to them all.

The replicas import nothing of the router; what they do in the router's Redis structures (their
calls' response streams, their load reports) and their tracing setup is the router's code,
bound here into a ``ReplicaServices`` (``replica_services``) that each replica deployment gets.

The ``OTEL_*`` variables of the process that builds the application are handed to both
deployments (their actors may run on other nodes of an existing Ray cluster, which do not
inherit this environment), so tracing is configured where ``fairserve up`` runs; those that
name files (TLS certificates, client keys) are made absolute first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.autoscaling import AutoscaleSettings, BacklogPolicy
from cluster.settings import (
    REPLICA_STOP_MARGIN_S,
    FairserveSettings,
    RoutingPolicy,
    ServedModelSettings,
)
from replicas.engine.local_path import absolute_path
from replicas.protocol import ModelInfo, ReplicaServices
from replicas.server import EngineFactory, ModelReplica, ReplicaOptions
from router.dispatch.prefix_affinity import PrefixAffinityRouter
from router.dispatch.stream_writer import StreamWriter
from router.server import RoutedModel, RouterServer
from router.state.load_report import LoadReporter
from router.state.nodes import this_node
from router.telemetry.tracing import configure_tracing

REPLICA_DEPLOYMENT = "ModelReplica"
ROUTER_DEPLOYMENT = "Router"


def build_app(settings: FairserveSettings, models: ModelInfo | list[ModelInfo], redis_url: str,
              engine_factory: EngineFactory | None = None) -> Application:
    """The application; ``settings`` come from ``cluster.placement.place`` (CPUs decided);
    ``models``: what the router knows of each served model, in ``settings.served_models()``'s
    order (the default first)."""
    infos = [models] if isinstance(models, ModelInfo) else list(models)
    served = settings.served_models()
    assert len(infos) == len(served), "one ModelInfo per served model"
    routed = [RoutedModel(info, _replica_deployment(settings, model, redis_url, engine_factory),
                          model.pool, model.aliases)
              for model, info in zip(served, infos, strict=True)]
    ro = settings.router
    api = ro.api
    if any(m.replicas.autoscaling is not None and m.replicas.autoscaling.allow_scale_to_zero
           for m in served):
        api = api.model_copy(update={"allow_scale_from_zero": True})
    router = serve.deployment(
        RouterServer,
        name=ROUTER_DEPLOYMENT,
        num_replicas=ro.num_replicas,
        max_ongoing_requests=ro.max_ongoing_requests,
        # Serve waits this long for the router's open HTTP requests (its clients' streams)
        # before it stops it: a redeploy must not cut them (tests/chaos/test_drain.py)
        graceful_shutdown_timeout_s=ro.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": ro.num_cpus, "resources": dict(ro.resources),
                           "runtime_env": otel_runtime_env()},
    ).bind(routed, redis_url, api, settings.queues,  # type: ignore[attr-defined]
           ro.dispatch)
    return router


def replica_deployment_name(pool: str) -> str:
    """The model replicas' deployment of a model's pool ("": the default model's)."""
    return REPLICA_DEPLOYMENT if not pool else f"{REPLICA_DEPLOYMENT}-{pool}"


def _replica_deployment(settings: FairserveSettings, model: ServedModelSettings, redis_url: str,
                        engine_factory: EngineFactory | None) -> Application:
    r = model.replicas
    assert r.num_cpus is not None, "cluster.placement.place decides the replicas' CPUs first"
    options = ReplicaOptions(
        engine=model.engine,
        max_ongoing_requests=r.max_ongoing_requests,
        report_interval_s=r.report_interval_s,
        drain_timeout_s=r.graceful_shutdown_timeout_s,
    )
    scaling: dict[str, Any] = {"num_replicas": r.num_replicas} if r.autoscaling is None else {
        "autoscaling_config": autoscaling_config(r.autoscaling, redis_url, model.pool)}
    return serve.deployment(  # type: ignore[no-any-return]
        ModelReplica,
        name=replica_deployment_name(model.pool),
        **scaling,
        max_ongoing_requests=r.max_ongoing_requests,
        ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus,
                           "resources": dict(r.resources), "runtime_env": otel_runtime_env()},
        health_check_period_s=r.health_check_period_s,
        health_check_timeout_s=r.health_check_timeout_s,
        # Ray Serve's own wait comes on top of the replica's drain in __del__
        graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s + REPLICA_STOP_MARGIN_S,
        request_router_config=request_router_config(model),
    ).bind(options, replica_services(redis_url), engine_factory)  # type: ignore[attr-defined]


def replica_services(redis_url: str) -> ReplicaServices:
    """The router's code a model replica runs (``replicas.protocol.services``): its calls'
    response streams and its load reports in the Redis at ``redis_url`` (as written: each
    replica adds the password from its own environment), the router's tracing setup, and
    where it runs. Classes and module functions, so Ray pickles them by reference."""
    return ReplicaServices(stream_sink=partial(StreamWriter, redis_url),
                           load_publisher=partial(LoadReporter, redis_url),
                           tracing=configure_tracing, node_name=this_node)


def request_router_config(model: ServedModelSettings) -> RequestRouterConfig:
    """How the routers' handles pick a replica of the model (``replicas.routing``)."""
    routing = model.replicas.routing
    config: dict[str, Any] = {
        "request_routing_stats_period_s": routing.publish_period_s,
        "request_routing_stats_timeout_s": max(5.0, 2 * routing.publish_period_s)}
    if routing.policy is RoutingPolicy.PREFIX_AFFINITY:
        config["request_router_class"] = PrefixAffinityRouter
        config["request_router_kwargs"] = {"block_size": model.engine.block_size,
                                           "min_match_blocks": routing.min_match_blocks,
                                           "max_imbalance": routing.max_imbalance}
    return RequestRouterConfig(**config)


def autoscaling_config(a: AutoscaleSettings, redis_url: str, pool: str = "") -> dict[str, Any]:
    """Ray Serve's autoscaling config running ``BacklogPolicy`` on the backlog of ``pool``
    (a model's queues); Ray's own delays are zero because the policy applies ours
    (``cluster/autoscaling.py``)."""
    return {
        "min_replicas": a.floor, "max_replicas": a.max_replicas,
        "initial_replicas": max(a.floor, 1) if a.floor else 0,
        "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0,
        "metrics_interval_s": a.metrics_interval_s, "look_back_period_s": 2 * a.metrics_interval_s,
        "policy": {"policy_function": f"{BacklogPolicy.__module__}:{BacklogPolicy.__name__}",
                   "policy_kwargs": {"redis_url": redis_url, "settings": a.model_dump(),
                                     "pool": pool}},
    }


# OTEL_* variables that name files (the exporter's TLS certificate and client key, also per
# signal: OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE ...): the actors read them in other directories
_OTEL_FILE_SUFFIXES = ("_CERTIFICATE", "_CLIENT_KEY")


def otel_runtime_env(env: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    env_vars = {k: absolute_path(v) if k.endswith(_OTEL_FILE_SUFFIXES) else v
                for k, v in env.items() if k.startswith("OTEL_")}
    return {"env_vars": env_vars} if env_vars else {}
