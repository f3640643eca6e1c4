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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, model_validator
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


class ProxyLocation(enum.StrEnum):
    """Where Ray Serve runs its HTTP proxies (its ``ProxyLocation``)."""

    EVERY_NODE = "EveryNode"
    HEAD_ONLY = "HeadOnly"


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
    proxy_location: ProxyLocation = Field(
        ProxyLocation.EVERY_NODE, description="where Ray Serve runs its HTTP proxies: "
        "`EveryNode` (Ray's default: each node with a replica), or `HeadOnly` (one ingress, "
        "on the head; what several Ray nodes on one machine need, as they share its ports)")
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
    quiet: bool = Field(
        True, description="a local Ray with its own background work turned down "
        "(cluster/ray_quiet.py: no task records, no Ray metrics, Serve's control loop every "
        "0.5 s): an idle cluster takes 30-40 % less CPU from the engine; false: Ray's defaults"
    )


class TenantsSettings(_Branch):
    file: LocalPath | None = Field(None, description="YAML file of tenants loaded at start")
    create_demo: bool = Field(
        True, description="create tenant 'demo' and print a key when no tenant exists"
    )


LEASE_RENEWALS = 3  # a lease outlives this many renewal periods: one late renewal keeps it
MAX_MODELS = 32  # base models one cluster serves (each its own deployment and queues)
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # a base model's name or alias (keys.POOL_PATTERN)


class ModelSettings(_Branch):
    """Another base model served beside the default one (which the top-level `engine` and
    `replicas` describe): its own engine, its own replicas (a deployment of its own, scaled on
    its own backlog) and its own queues in Redis, so that a flood on one model neither delays
    nor scales another. Clients choose it by `engine.served_model_name` or an alias."""

    engine: EngineConfig = Field(description="its engine; `served_model_name` is the name "
                                 "requests give (and the name of its queues and deployment)")
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings,
                                      description="its replicas, as the top-level `replicas`")
    aliases: list[Annotated[str, StringConstraints(pattern=MODEL_NAME)]] = Field(
        default_factory=list, max_length=16, description="other names requests may give it")


@dataclass(frozen=True, slots=True)
class ServedModelSettings:
    """One base model of the cluster as the deployments see it: ``pool`` names its queues
    (and its deployment's suffix): "" for the default model."""

    pool: str
    engine: EngineConfig
    replicas: ReplicaSettings
    aliases: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.engine.served_model_name


def _check_model_names(served: list[ServedModelSettings]) -> None:
    """Every name a request may give (models, aliases, the adapters the settings name) means
    one thing, and each model's name can name its queues and its deployment."""
    seen: dict[str, str] = {}
    for i, model in enumerate(served):
        where = "engine" if not model.pool else f"models[{i - 1}].engine"
        if not re.match(MODEL_NAME, model.name):
            raise ValueError(f"{where}.served_model_name {model.name!r}: 1-64 of letters, "
                             "digits and ._- (it names the model's queues and deployment)")
        names = [(model.name, f"{where}.served_model_name"),
                 *((a, f"{where.removesuffix('engine')}aliases" if model.pool else "aliases")
                   for a in model.aliases),
                 *((a, f"{where}.lora_adapters") for a in model.engine.lora_adapters)]
        for name, field in names:
            if name in seen:
                raise ValueError(f"{field}: the name {name!r} is already taken by "
                                 f"{seen[name]}: a request's `model` must name one thing")
            seen[name] = field


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
    aliases: list[Annotated[str, StringConstraints(pattern=MODEL_NAME)]] = Field(
        default_factory=list, max_length=16,
        description="other names requests may give the default model (`engine`)")
    models: list[ModelSettings] = Field(
        default_factory=list, max_length=MAX_MODELS - 1,
        description="more base models beside the default one, each with its own engine, "
        "replicas and aliases (deploy/examples/models.yaml); the request's `model` picks one")

    def served_models(self) -> list[ServedModelSettings]:
        """The default model (pool "") and then each of ``models`` (pool: its name)."""
        return [ServedModelSettings("", self.engine, self.replicas, tuple(self.aliases)),
                *(ServedModelSettings(m.engine.served_model_name, m.engine, m.replicas,
                                      tuple(m.aliases)) for m in self.models)]

    def with_served(self, served: list[ServedModelSettings]) -> FairserveSettings:
        """These settings with each model's engine and replicas replaced (placement)."""
        default, *others = served
        models = [m.model_copy(update={"engine": s.engine, "replicas": s.replicas})
                  for m, s in zip(self.models, others, strict=True)]
        return self.model_copy(update={"engine": default.engine, "replicas": default.replicas,
                                       "models": models})

    @model_validator(mode="after")
    def _check(self) -> FairserveSettings:
        for i, served in enumerate(self.served_models()):
            at = "" if not served.pool else f"models[{i - 1}]."
            slots = served.replicas.max_ongoing_requests
            if slots > served.engine.max_num_seqs:
                raise ValueError(
                    f"{at}replicas.max_ongoing_requests ({slots}) exceeds {at}engine.max_num_seqs"
                    f" ({served.engine.max_num_seqs}): requests would wait inside the engine, "
                    "out of sight of the fair queues")
        _check_model_names(self.served_models())
        replica_stop_s = self.replicas.graceful_shutdown_timeout_s + REPLICA_STOP_MARGIN_S
        if self.router.graceful_shutdown_timeout_s <= replica_stop_s:
            raise ValueError(
                f"router.graceful_shutdown_timeout_s ({self.router.graceful_shutdown_timeout_s}) "
                f"is not above replicas.graceful_shutdown_timeout_s + {REPLICA_STOP_MARGIN_S:g} "
                f"({replica_stop_s:g}): a redeploy would stop the routers while their clients' "
                "streams still wait for the old replicas, and cut them")
        renew_s, lease_s = self.router.dispatch.renew_s, self.queues.lease_ms / 1000
        if renew_s * LEASE_RENEWALS > lease_s:
            raise ValueError(
                f"router.dispatch.renew_s ({renew_s:g}) is more than a {LEASE_RENEWALS}th of "
                f"queues.lease_ms ({self.queues.lease_ms}): a lease would lapse between two "
                "renewals of a busy router, and its requests be taken from it mid-stream; "
                f"set renew_s to at most {lease_s / LEASE_RENEWALS:g}")
        fewest = min(m.engine.max_num_seqs for m in self.served_models())
        if self.router.api.max_n > fewest:
            raise ValueError(
                f"router.api.max_n ({self.router.api.max_n}) exceeds engine.max_num_seqs "
                f"({fewest}, of a model): the choices of one request could never run "
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
