"""The one settings tree of a fairserve cluster.

Sources, strongest first: arguments given in code, ``FAIRSERVE_*`` environment variables
(nested with ``__``: ``FAIRSERVE_REPLICAS__NUM_REPLICAS=2``,
``FAIRSERVE_ENGINE__NUM_THREADS=1``), then a YAML file (``fairserve up --config FILE``) with the
same shape. Every branch forbids unknown keys, so a typo is an error naming it. The Helm chart's
values map one-to-one onto these fields.
"""

from __future__ import annotations

import contextvars
import enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from cluster.autoscaling import AutoscaleSettings
from cluster.redis_server import AppendFsync
from replicas.engine.config import EngineConfig
from replicas.engine.local_path import LocalPath, resolve_yaml_paths
from router.config import ApiSettings, QueueSettings
from router.dispatch.dispatcher import DispatchSettings
from router.state.redis_client import password_of, with_password

# Ray Serve's wait for a stopping model replica beyond the replica's own drain (cluster/app.py)
REPLICA_STOP_MARGIN_S = 5.0
DEFAULT_STATE_DIR = Path(".fairserve")  # cluster/cli.py spells it too (it must not import torch)
_YAML_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("yaml", default=None)


class _Branch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ingress(enum.StrEnum):
    """What takes the clients' HTTP connections in front of the routers."""

    PROXY = "proxy"  # Ray Serve's HTTP proxy, a Python process of its own (a hop per chunk)
    HAPROXY = "haproxy"  # Ray Serve's HAProxy ingress (C) before the routers' own HTTP ports


class RoutingPolicy(enum.StrEnum):
    PREFIX_AFFINITY = "prefix_affinity"  # router/dispatch/prefix_affinity.py
    LEAST_LOADED = "least_loaded"  # Ray Serve's power of two choices


class RoutingSettings(_Branch):
    policy: RoutingPolicy = Field(
        RoutingPolicy.PREFIX_AFFINITY,
        description="how a request picks its replica: prefix_affinity (where its prompt's "
        "leading blocks are cached, balanced against load) or least_loaded (the less loaded of "
        "two random replicas)")
    max_imbalance: int = Field(
        8, ge=0, description="prefix_affinity: a replica that matches keeps the request while "
        "it holds at most this many requests more than the least loaded one")
    min_match_blocks: int = Field(
        1, ge=1, description="prefix_affinity: the fewest leading cached blocks (of "
        "engine.block_size tokens) that count as a match")
    publish_period_s: float = Field(
        1.0, gt=0, le=60, description="how often each replica hands Ray Serve its cached block "
        "hashes for the routers (Ray's request_routing_stats_period_s)")


class ReplicaSettings(_Branch):
    num_replicas: int = Field(1, ge=0, le=1024,
                              description="model replicas (a fixed count, without autoscaling)")
    autoscaling: AutoscaleSettings | None = Field(
        None, description="scale the replicas on the Redis backlog (cluster/autoscaling.py); "
        "none: num_replicas, fixed")
    num_cpus: float | None = Field(
        None, ge=0, description="CPUs Ray reserves for each replica; default: fit the machine "
        "(the CPUs left after the routers, shared by the replicas, at most 1 each; "
        "cluster/placement.py)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each replica")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each replica needs (the Helm "
        "chart's model worker groups advertise `fairserve_model`, so replicas land there)")
    max_ongoing_requests: int = Field(
        32, ge=1, le=4096,
        description="requests one replica takes at once; the dispatchers never lease more",
    )
    health_check_period_s: float = Field(5.0, gt=0, description="Ray Serve health check period")
    health_check_timeout_s: float = Field(30.0, gt=0, description="health check timeout")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="how long a removed replica may finish its running requests"
    )
    report_interval_s: float = Field(0.5, gt=0, le=5, description="load report period")
    routing: RoutingSettings = Field(default_factory=RoutingSettings,
                                     description="which replica a request goes to")


class RouterSettings(_Branch):
    num_replicas: int = Field(1, ge=1, le=1024, description="router (ingress) replicas")
    num_cpus: float = Field(0.25, ge=0, description="CPUs Ray reserves for each router")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each router needs (the Helm "
        "chart's router worker group advertises `fairserve_router`)")
    host: str = Field("127.0.0.1", description="HTTP bind address of the ingress and of "
                      "each router's own port")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    max_ongoing_requests: int = Field(
        2000, ge=1, description="HTTP requests one router replica holds at once (most wait)"
    )
    ingress: Ingress = Field(
        Ingress.HAPROXY, description="`haproxy`: Ray Serve's throughput mode "
        "(RAY_SERVE_THROUGHPUT_OPTIMIZED: direct gRPC between deployments, user code on the "
        "replica's own event loop) with its HAProxy ingress on `host`:`port` in front of each "
        "router's own HTTP port, bound on `host` too (RAY_SERVE_ENABLE_HA_PROXY): no Python hop "
        "between the client and the router; `proxy`: Ray Serve's Python HTTP proxy, a process "
        "hop per chunk (make bench-serving-path measures both). Set on the Ray "
        "processes' environment: `fairserve up` sets it in the Ray it starts, the Helm chart on "
        "every Ray pod; a Ray cluster `fairserve up` joins needs those variables itself")
    graceful_shutdown_timeout_s: float = Field(
        90.0, ge=0, description="how long a stopping router keeps relaying its clients' "
        "streams before it exits (a redeploy replaces the routers and the model replicas at "
        "once, so its streams wait for the replicas' drain, a migration and a new replica); "
        "above replicas.graceful_shutdown_timeout_s + 5, and below the pods' "
        "terminationGracePeriodSeconds")
    api: ApiSettings = Field(default_factory=ApiSettings)
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings)


class RedisSettings(_Branch):
    url: str | None = Field(
        None, description="an existing Redis (redis://, rediss://), or Redis Sentinel "
        "(redis+sentinel://host:port[,host:port...]/<service>[/<db>]: the clients follow a "
        "failover by themselves; see queues.replicas_to_ack); none: start the embedded one"
    )
    password: SecretStr | None = Field(
        None, description="the password of `url`, when the URL has none (from "
        "$FAIRSERVE_REDIS__PASSWORD, e.g. a Kubernetes secretKeyRef, so that the URL itself can "
        "be written down)")
    password_file: LocalPath | None = Field(
        None, description="a file holding that password (a mounted Kubernetes Secret; from "
        "$FAIRSERVE_REDIS__PASSWORD_FILE); `password` wins")
    username: str | None = Field(
        None, description="the Redis ACL user of that password, when the URL names none (from "
        "$FAIRSERVE_REDIS__USERNAME; the Helm chart gives routers and model replicas users of "
        "their own); none: Redis's default user")
    port: int = Field(6390, ge=1, le=65535, description="port of the embedded redis-server")
    appendfsync: AppendFsync = Field(
        AppendFsync.EVERYSEC, description="AOF fsync policy of the embedded redis-server"
    )


    def url_with_password(self) -> str | None:
        """``url`` with ``password`` in it (when the URL has none of its own)."""
        if self.url is None:
            return None
        given = self.password.get_secret_value() if self.password is not None else None
        path = str(self.password_file) if self.password_file is not None else None
        return with_password(self.url, password_of(given, path), self.username)


class RaySettings(_Branch):
    address: str | None = Field(
        None, description="an existing Ray cluster ('auto', 'ray://host:10001'); none: local"
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray; default: all")


class TenantsSettings(_Branch):
    file: LocalPath | None = Field(None, description="YAML file of tenants loaded at start")
    create_demo: bool = Field(
        True, description="create tenant 'demo' and print a key when no tenant exists"
    )


class FairserveSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FAIRSERVE_", env_nested_delimiter="__",
                                      extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    queues: QueueSettings = Field(default_factory=QueueSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    tenants: TenantsSettings = Field(default_factory=TenantsSettings)
    state_dir: LocalPath = Field(DEFAULT_STATE_DIR, validate_default=True,
                                 description="embedded Redis data, run state")
    app_name: str = Field("fairserve", min_length=1, description="Ray Serve application name")

    @model_validator(mode="after")
    def _check(self) -> FairserveSettings:
        slots = self.replicas.max_ongoing_requests
        if slots > self.engine.max_num_seqs:
            raise ValueError(
                f"replicas.max_ongoing_requests ({slots}) exceeds engine.max_num_seqs "
                f"({self.engine.max_num_seqs}): requests would wait inside the engine, out of "
                "sight of the fair queues")
        replica_stop_s = self.replicas.graceful_shutdown_timeout_s + REPLICA_STOP_MARGIN_S
        if self.router.graceful_shutdown_timeout_s <= replica_stop_s:
            raise ValueError(
                f"router.graceful_shutdown_timeout_s ({self.router.graceful_shutdown_timeout_s}) "
                f"is not above replicas.graceful_shutdown_timeout_s + {REPLICA_STOP_MARGIN_S:g} "
                f"({replica_stop_s:g}): a redeploy would stop the routers while their clients' "
                "streams still wait for the old replicas, and cut them")
        if self.router.api.max_n > self.engine.max_num_seqs:
            raise ValueError(
                f"router.api.max_n ({self.router.api.max_n}) exceeds engine.max_num_seqs "
                f"({self.engine.max_num_seqs}): the choices of one request could never run "
                "together")
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        yaml_file = _YAML_FILE.get()
        if yaml_file is not None:
            sources.append(_YamlSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


class _YamlSource(YamlConfigSettingsSource):
    """The settings file, its relative paths read against the file's own directory."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        base = Path(self.yaml_file_path).resolve().parent  # type: ignore[arg-type]
        resolved: dict[str, Any] = resolve_yaml_paths(FairserveSettings, data, base)
        return resolved


def load_settings(yaml_file: str | Path | None = None, **overrides: Any) -> FairserveSettings:
    """Settings from ``overrides``, the environment and ``yaml_file``, in that order."""
    if yaml_file is not None and not Path(yaml_file).is_file():
        raise FileNotFoundError(f"settings file {yaml_file} does not exist")
    token = _YAML_FILE.set(Path(yaml_file) if yaml_file is not None else None)
    try:
        return FairserveSettings(**overrides)
    finally:
        _YAML_FILE.reset(token)
