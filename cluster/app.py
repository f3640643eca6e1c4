"""Builds the Ray Serve application from the settings tree: the model replica deployment and
the router ingress deployment bound to it.

The ``OTEL_*`` variables of the process that builds the application are handed to both
deployments (their actors may run on other nodes of an existing Ray cluster, which do not
inherit this environment), so tracing is configured where ``fairserve up`` runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ray import serve
from ray.serve import Application

from cluster.settings import FairserveSettings
from replicas.server import EngineFactory, ModelReplica, ReplicaOptions
from router.prompt_tokenizer import ModelInfo
from router.server import RouterServer

REPLICA_DEPLOYMENT = "ModelReplica"
ROUTER_DEPLOYMENT = "Router"


def build_app(settings: FairserveSettings, model: ModelInfo, redis_url: str,
              engine_factory: EngineFactory | None = None) -> Application:
    r = settings.replicas
    options = ReplicaOptions(
        engine=settings.engine,
        max_ongoing_requests=r.max_ongoing_requests,
        redis_url=redis_url,
        report_interval_s=r.report_interval_s,
        drain_timeout_s=r.graceful_shutdown_timeout_s,
    )
    replica = serve.deployment(
        ModelReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=r.num_replicas,
        max_ongoing_requests=r.max_ongoing_requests,
        ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus,
                           "runtime_env": otel_runtime_env()},
        health_check_period_s=r.health_check_period_s,
        health_check_timeout_s=r.health_check_timeout_s,
        # Ray Serve's own wait comes on top of the replica's drain in __del__
        graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s + 5,
    ).bind(options, engine_factory)  # type: ignore[attr-defined]
    ro = settings.router
    router = serve.deployment(
        RouterServer,
        name=ROUTER_DEPLOYMENT,
        num_replicas=ro.num_replicas,
        max_ongoing_requests=ro.max_ongoing_requests,
        ray_actor_options={"num_cpus": ro.num_cpus, "runtime_env": otel_runtime_env()},
    ).bind(replica, model, redis_url, ro.api, settings.queues,  # type: ignore[attr-defined]
           ro.dispatch)
    return router


def otel_runtime_env(env: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    env_vars = {k: v for k, v in env.items() if k.startswith("OTEL_")}
    return {"env_vars": env_vars} if env_vars else {}
