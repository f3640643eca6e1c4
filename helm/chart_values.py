"""The Helm chart's values, as typed models: the one source of ``helm/fairserve/values.yaml``
(every value with its ``# --`` description) and ``helm/fairserve/values.schema.json`` (JSON
Schema draft 2020-12, self-contained, ``additionalProperties: false`` on every object the chart
owns; Kubernetes objects passed through stay open).

    python helm/chart_values.py           # write both files
    python helm/chart_values.py --check   # exit 1 if either is stale (the tests run this)

The ``fairserve:`` branch is the settings tree itself (``cluster/settings.py``): its models are
reused, minus the fields the chart owns (the model path, the device, the router's bind address,
the custom Ray resources that steer the deployments), so a value means here what it means to
``fairserve up``, with the same bounds and the same descriptions.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from cluster.autoscaling import AutoscaleSettings  # noqa: E402
from cluster.settings import ReplicaSettings, RouterSettings  # noqa: E402
from replicas.engine.config import EngineConfig  # noqa: E402
from router.config import QueueSettings  # noqa: E402

CHART = REPO / "helm" / "fairserve"
VALUES_FILE = CHART / "values.yaml"
SCHEMA_FILE = CHART / "values.schema.json"
WIDTH = 96
DNS_LABEL = r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$"
Quantity = str | int | float  # a Kubernetes quantity: "4", "500m", "16Gi"
NOT_LATEST: dict[str, Any] = {"not": {"const": "latest"}}  # pinned tags only (Helm's RE2: no lookahead)
KubeObject = dict[str, Any]  # passed through to Kubernetes as it is


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _subset(name: str, of: type[BaseModel], drop: set[str], required: set[str] = frozenset(),
            described: dict[str, str] | None = None, **changed: Any) -> Any:
    """``of``'s fields minus ``drop``, some with chart defaults (same bounds); the fields
    in ``required`` may not be null (their "decide at run time" means nothing in a chart)."""
    fields: dict[str, Any] = {}
    for field_name, info in of.model_fields.items():
        if field_name in drop:
            continue
        if field_name in changed:
            info = FieldInfo.merge_field_infos(info, default=changed[field_name])
            info.default_factory = None
        if described and field_name in described:
            info = FieldInfo.merge_field_infos(info, description=described[field_name])
        annotation = info.annotation
        if field_name in required:
            annotation = next(a for a in annotation.__args__ if a is not type(None))
        fields[field_name] = (annotation, info)
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


EngineValues = _subset("EngineValues", EngineConfig, {"model", "model_cache_dir", "device"})
ReplicaValues = _subset(
    "ReplicaValues", ReplicaSettings, {"resources"}, {"num_cpus"},
    {"num_cpus": "CPUs Ray reserves for each replica (must fit a model group's pods)",
     "autoscaling": "scale the replicas on the Redis backlog (cluster/autoscaling.py); the Ray "
                    "autoscaler turns replicas into pods of the model groups and removes idle "
                    "ones; null: num_replicas, fixed"},
    num_cpus=1.0, autoscaling=AutoscaleSettings())
RouterValues = _subset("RouterValues", RouterSettings, {"resources", "host", "port"},
                       num_replicas=2, num_cpus=0.5)
ModelEngineValues = _subset(
    "ModelEngineValues", EngineConfig, {"model_cache_dir", "device"}, set(),
    {"model": "the model (a GGUF file or a Hugging Face directory): an absolute path in the "
              "pods, under model.pvc.mountPath for a PVC; empty: the image's default model",
     "served_model_name": "its name (requests give it as `model`; it also names its queues "
                          "and its Serve deployment): set it, to another than the default "
                          "model's"},
    model="")


class ModelValues(_Values):
    engine: ModelEngineValues = Field(description="Its engine.")  # type: ignore[valid-type]
    replicas: ReplicaValues = Field(  # type: ignore[valid-type]
        default_factory=ReplicaValues, description="Its replicas, as fairserve.replicas (in "
        "the model worker groups); what it leaves out is the default model's.")
    aliases: list[str] = Field(default_factory=list, max_length=16,
                               description="Other names requests may give it.")


class FairserveValues(_Values):
    engine: EngineValues = Field(default_factory=EngineValues)  # type: ignore[valid-type]
    replicas: ReplicaValues = Field(default_factory=ReplicaValues)  # type: ignore[valid-type]
    router: RouterValues = Field(default_factory=RouterValues)  # type: ignore[valid-type]
    queues: QueueSettings = Field(default_factory=QueueSettings)
    aliases: list[str] = Field(default_factory=list, max_length=16,
                               description="Other names requests may give the default model.")
    models: list[ModelValues] = Field(
        default_factory=list, description="More base models beside the default one (engine, "
        "replicas): each its own Serve deployment, queues and autoscaling; the request's "
        "`model` picks one (deploy/examples/models.yaml). The chart sets each one's device "
        "from its replicas.num_gpus and places its replicas in the model worker groups.")


class Global(_Values):
    imageRegistry: str = Field("", description="Registry put before every image repository "
                               "(mirrors, air-gapped clusters).")
    imagePullSecrets: list[str] = Field(default_factory=list, description="Image pull secrets "
                                        "(names) for every pod.")


class Image(_Values):
    repository: str = Field("fairserve/fairserve", min_length=1, description="The fairserve "
                            "CPU image (deploy/images/Containerfile.cpu): Ray, fairserve and the "
                            "default model; the head, the routers and CPU model groups run it.")
    tag: str = Field("", description="Image tag; default: the chart's appVersion. Never "
                     "`latest`.", json_schema_extra=NOT_LATEST)
    digest: str = Field("", pattern=r"^(sha256:[0-9a-f]{64})?$",
                        description="Image digest (sha256:...); wins over the tag.")
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the fairserve images.")


class GpuImage(_Values):
    repository: str = Field("fairserve/fairserve", min_length=1, description="The fairserve "
                            "CUDA image (deploy/images/Containerfile.cuda, on a pinned Ray CUDA "
                            "image) for GPU model groups.")
    tag: str = Field("", json_schema_extra=NOT_LATEST,
                     description="Image tag; default: the chart's appVersion with `-cuda`.")
    digest: str = Field("", pattern=r"^(sha256:[0-9a-f]{64})?$",
                        description="Image digest; wins over the tag.")


class PvcCreate(_Values):
    size: str = Field("50Gi", description="Size of the claim the chart creates.")
    storageClass: str = Field("", description="Storage class; empty: the cluster's default.")
    accessModes: list[Literal["ReadWriteMany", "ReadOnlyMany", "ReadWriteOnce",
                              "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"], min_length=1,
        description="Access modes: every Ray pod mounts it, so ReadWriteMany (or ReadOnlyMany).")


class ModelPvc(_Values):
    existingClaim: str = Field("", description="An existing claim holding the model "
                               "(ReadWriteMany or ReadOnlyMany: every Ray pod mounts it); empty: "
                               "the chart creates one (model.pvc.create), kept on uninstall.")
    mountPath: str = Field("/models", pattern=r"^/", description="Where the claim is mounted "
                           "in the Ray pods (read-only).")
    create: PvcCreate = Field(default_factory=PvcCreate)


class Model(_Values):
    source: Literal["image", "pvc"] = Field("image", description="Where the model comes from: "
                                            "`image` (inside the image; the default model needs "
                                            "nothing) or `pvc` (a volume on every Ray pod). "
                                            "Nothing is downloaded at run time.")
    path: str = Field("", description="The model (a GGUF file or a Hugging Face directory): an "
                      "absolute path in the pods (under model.pvc.mountPath for a PVC); empty: "
                      "the image's default model (SmolLM2-135M-Instruct).")
    cacheDir: str = Field("", description="Where a GGUF model's prepared copy is written "
                          "(engine.model_cache_dir); empty: the image's own cache (the default "
                          "model's copy is baked in). Under /tmp it is the pod's emptyDir.")
    pvc: ModelPvc = Field(default_factory=ModelPvc)


class CpuMemory(_Values):
    cpu: Quantity = Field(description="CPU (requests = limits).")
    memory: Quantity = Field(description="Memory (requests = limits: KubeRay sizes /dev/shm "
                             "from it).")


def _resources(cpu: str, memory: str) -> Any:
    return Field(default_factory=lambda: CpuMemory(cpu=cpu, memory=memory),
                 description="Resources of a pod (requests = limits).")


RAY_START_PARAMS = Field(default_factory=dict, description="Extra `ray start` parameters "
                         "(string values, as the RayCluster CRD types them).")


class Head(_Values):
    resources: CpuMemory = _resources("1", "4Gi")
    rayStartParams: dict[str, str] = RAY_START_PARAMS
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Node selector.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Tolerations.")
    affinity: KubeObject = Field(default_factory=dict, description="Affinity.")
    priorityClassName: str = Field("", description="Priority class.")


class Autoscaler(_Values):
    idleTimeoutSeconds: int = Field(60, ge=0, description="Seconds a worker pod stays idle "
                                    "before the Ray autoscaler removes it.")
    upscalingMode: Literal["Default", "Aggressive", "Conservative"] = Field(
        "Default", description="How fast the Ray autoscaler adds pods.")
    resources: CpuMemory = _resources("500m", "512Mi")


class RouterGroup(_Values):
    minReplicas: int = Field(1, ge=0, description="Fewest router pods (they run the routers: "
                             "the custom Ray resource `fairserve_router` steers them here).")
    maxReplicas: int = Field(3, ge=1, description="Most router pods.")
    resources: CpuMemory = _resources("2", "4Gi")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Node selector.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Tolerations.")
    affinity: KubeObject = Field(default_factory=dict, description="Affinity.")
    topologySpreadConstraints: list[KubeObject] = Field(default_factory=list,
                                                        description="Topology spread.")
    priorityClassName: str = Field("", description="Priority class.")
    rayStartParams: dict[str, str] = RAY_START_PARAMS


class ModelGroup(_Values):
    """A list item: Helm does not merge list items with defaults, so a group names its
    name, maxReplicas and resources; the rest has defaults in the templates."""

    name: str = Field(pattern=DNS_LABEL, description="Group name (a DNS label).")
    minReplicas: int = Field(0, ge=0, description="Fewest pods (0: the group scales to zero "
                             "when idle).")
    maxReplicas: int = Field(ge=1, description="Most pods.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs per pod (0: a CPU group); requests = "
                      "limits of ray.accelerator.resourceName, and the GPU toleration.")
    resources: CpuMemory = Field(description="Resources of a pod (requests = limits).")
    ephemeralStorage: str = Field("10Gi", description="Scratch disk per pod (requests = "
                                  "limits): prepared weights, Ray's spill.")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Node selector "
                                         "(e.g. nvidia.com/gpu.product).")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Tolerations (a "
                                          "GPU group gets the accelerator's NoSchedule too).")
    affinity: KubeObject = Field(default_factory=dict, description="Affinity.")
    runtimeClassName: str = Field("", description="Runtime class (e.g. nvidia); empty: the "
                                  "cluster's default.")
    priorityClassName: str = Field("", description="Priority class.")
    topologySpreadConstraints: list[KubeObject] = Field(default_factory=list,
                                                        description="Topology spread.")
    rayStartParams: dict[str, str] = RAY_START_PARAMS


class Accelerator(_Values):
    resourceName: str = Field("nvidia.com/gpu", min_length=1, description="The extended "
                              "resource of GPU groups.")


class Ray(_Values):
    version: str = Field("2.60.0", pattern=r"^\d+\.\d+\.\d+$", description="Ray version of "
                         "the images (rayVersion).")
    terminationGracePeriodSeconds: int = Field(120, ge=0, description="Seconds a Ray pod has "
                                               "to stop; above the longest drain.")
    env: list[KubeObject] = Field(default_factory=list, description="Extra environment "
                                  "variables of every Ray container (secrets only through "
                                  "valueFrom.secretKeyRef).")
    quiet: bool = Field(True, description="Ray's own background work turned down on every Ray "
                        "pod (cluster/ray_quiet.py: no task records, no event-loop stats, the "
                        "Serve controller's loop every 0.5 s; Ray's metrics stay on for the "
                        "PodMonitor): less idle CPU; false: Ray's defaults.")
    head: Head = Field(default_factory=Head, description="The head: the Serve controller and "
                       "the HTTP proxy, never a replica (num-cpus and num-gpus \"0\").")
    autoscaler: Autoscaler = Field(default_factory=Autoscaler)
    routerGroup: RouterGroup = Field(default_factory=RouterGroup)
    modelGroups: list[ModelGroup] = Field(
        default_factory=lambda: [ModelGroup(name="cpu", maxReplicas=2,
                                            resources=CpuMemory(cpu="4", memory="16Gi"))],
        min_length=1,
        description="Model groups: worker pods for the model replicas (custom Ray resource "
        "`fairserve_model`). Groups may be appended later without a rebuild; changing one "
        "rebuilds the cluster (see upgrade.strategy).")
    accelerator: Accelerator = Field(default_factory=Accelerator)


class GcsFaultTolerance(_Values):
    enabled: bool = Field(False, description="Ray GCS fault tolerance (gcsFaultToleranceOptions):"
                          " the head can restart without losing the Serve applications. Needs a "
                          "standalone Redis.")
    redisAddress: str = Field("", description="host:port of that Redis; empty: the embedded one.")
    existingSecret: str = Field("", description="Secret with its password; empty: the embedded "
                                "Redis's Secret.")
    passwordKey: str = Field("password", description="Key of the password in that Secret.")


class IncrementalUpgrade(_Values):
    gatewayClassName: str = Field("", description="Gateway API class for incremental upgrades.")
    stepSizePercent: int = Field(10, ge=1, le=100, description="Traffic moved per step (%).")
    intervalSeconds: int = Field(60, ge=1, description="Seconds between steps.")
    maxSurgePercent: int = Field(100, ge=1, le=100, description="Most extra capacity (%).")


class Upgrade(_Values):
    strategy: Literal["NewCluster", "NewClusterWithIncrementalUpgrade", "None"] = Field(
        "NewCluster", description="KubeRay upgradeStrategy.type: NewCluster (a change to the Ray "
        "pods builds a whole new cluster: twice the pods, GPUs included, until the switch), "
        "NewClusterWithIncrementalUpgrade (alpha, Gateway API), None (such changes are not "
        "applied). Changes under `fairserve:` never rebuild: they are in-place Serve updates.")
    clusterDeletionDelaySeconds: int = Field(600, ge=0, description="How long the old cluster "
                                             "stays after a switch (s): above the longest stream.")
    incremental: IncrementalUpgrade = Field(default_factory=IncrementalUpgrade)


class RedisImage(_Values):
    repository: str = Field("redis", min_length=1, description="Redis image (6.2 or later; "
                            "fairserve uses Redis 6.2 commands only).")
    tag: str = Field("7.4.2-alpine", min_length=1, json_schema_extra=NOT_LATEST,
                     description="Pinned Redis image tag.")
    digest: str = Field("", pattern=r"^(sha256:[0-9a-f]{64})?$",
                        description="Image digest; wins over the tag.")
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent",
                                                                   description="Pull policy.")


class RedisAuth(_Values):
    enabled: bool = Field(True, description="Require a password.")
    existingSecret: str = Field("", description="Secret holding the password (one line, "
                                "any characters), and with roleUsers the routers' and the replicas': "
                                "`kubectl create secret generic fairserve-redis "
                                "--from-literal=password=$(openssl rand -hex 24) "
                                "--from-literal=router-password=$(openssl rand -hex 24) "
                                "--from-literal=replica-password=$(openssl rand -hex 24)`.")
    passwordKey: str = Field("password", description="Key of the password in that Secret.")
    roleUsers: bool = Field(True, description="A Redis ACL user per role, each with a password "
                            "of its own from the same Secret: the routers' (`fairserve-router`: "
                            "fairserve's keys, no admin commands) and the model replicas' "
                            "(`fairserve-replica`: only requests' records and streams and the "
                            "load reports; it cannot read or mint API keys or change tenants). "
                            "The head (the deploy-time tenants load, the autoscaler, the "
                            "operators' CLI) keeps the default user. Off: one password for all.")
    routerPasswordKey: str = Field("router-password", description="Key of the routers' "
                                   "password in that Secret (with roleUsers).")
    replicaPasswordKey: str = Field("replica-password", description="Key of the model "
                                    "replicas' password in that Secret (with roleUsers).")


class RedisPersistence(_Values):
    enabled: bool = Field(True, description="Keep the data on a PVC (else an emptyDir: a "
                          "restart loses every queue, tenant and key).")
    size: str = Field("8Gi", description="Size of the data volume.")
    storageClass: str = Field("", description="Storage class; empty: the cluster's default.")
    accessModes: list[str] = Field(default_factory=lambda: ["ReadWriteOnce"], min_length=1,
                                   description="Access modes of the data volume.")


class EmbeddedRedis(_Values):
    image: RedisImage = Field(default_factory=RedisImage)
    auth: RedisAuth = Field(default_factory=RedisAuth)
    appendfsync: Literal["always", "everysec"] = Field(
        "always", description="AOF fsync: `always` (nothing acknowledged is lost on a crash) or "
        "`everysec` (up to a second of writes).")
    maxmemory: str = Field("", description="maxmemory (e.g. 2gb); empty: 80% of the memory "
                           "limit. The policy is always noeviction: an evicted key would drop a "
                           "queued request silently.")
    persistence: RedisPersistence = Field(default_factory=RedisPersistence)
    resources: CpuMemory = _resources("1", "2Gi")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Node selector.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Tolerations.")
    affinity: KubeObject = Field(default_factory=dict, description="Affinity.")


class ExternalRedis(_Values):
    url: str = Field("", pattern=r"^((rediss?|redis\+sentinel)://.*)?$",
                     description="The Redis URL without its password: redis:// or rediss:// (a "
                     "standalone Redis or a primary), or redis+sentinel://host:port[,host:port]"
                     "/<service> (Sentinel: the pods follow a failover by themselves; set "
                     "fairserve.queues.replicas_to_ack so an acknowledged request survives it).")
    existingSecret: str = Field("", description="Secret with its password; empty: none.")
    passwordKey: str = Field("password", description="Key of the password in that Secret.")


class Redis(_Values):
    mode: Literal["embedded", "external"] = Field("embedded", description="`embedded` (a "
                                                   "StatefulSet of this release) or `external`.")
    embedded: EmbeddedRedis = Field(default_factory=EmbeddedRedis)
    external: ExternalRedis = Field(default_factory=ExternalRedis)


class Tenants(_Values):
    existingSecret: str = Field("", description="Secret with a tenants file (API keys as SHA-256"
                                " digests only: `fairserve tenants key-new ID` makes a key and its"
                                " entry), loaded on every deploy. Empty: add tenants with "
                                "`fairserve tenants` through a port-forward to Redis.")
    key: str = Field("tenants.yaml", description="Key of the file in that Secret.")


class AdminService(_Values):
    enabled: bool = Field(True, description="A Service in front of the router pods' admin port "
                          "(fairserve.router.api.admin_port: tenants, keys, usage, audit; admin "
                          "tokens only); never the API's Service.")
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Service type; ClusterIP keeps it inside the cluster "
        "(kubectl port-forward for an operator's CLI).")


class Admin(_Values):
    existingSecret: str = Field("", description="Secret with an admin tokens file (SHA-256 "
                                "digests only: `fairserve admin token-new` makes a token and "
                                "its entry), reconciled on every deploy. Empty: make tokens with "
                                "`fairserve admin token-create` through a port-forward to Redis.")
    key: str = Field("admin-tokens.yaml", description="Key of the file in that Secret.")
    service: AdminService = Field(default_factory=AdminService)


class Telemetry(_Values):
    otlpEndpoint: str = Field("", description="OTLP endpoint of the traces "
                              "(OTEL_EXPORTER_OTLP_ENDPOINT); empty: tracing off.")
    protocol: Literal["http/protobuf", "grpc"] = Field("http/protobuf",
                                                       description="OTLP protocol.")
    sampler: str = Field("parentbased_traceidratio", description="OTEL_TRACES_SAMPLER.")
    samplerArg: str = Field("0.1", description="OTEL_TRACES_SAMPLER_ARG.")


class Ingress(_Values):
    enabled: bool = Field(False, description="An Ingress to the Serve service (the OpenAI API, "
                          "port 8000) only; never the Ray dashboard or client ports.")
    className: str = Field("", description="Ingress class.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations (e.g. "
                                        "timeouts long enough for streams).")
    hosts: list[str] = Field(default_factory=list, description="Host names.")
    tls: list[KubeObject] = Field(default_factory=list, description="TLS sections.")


class HttpRoute(_Values):
    enabled: bool = Field(False, description="A Gateway API HTTPRoute to the Serve service "
                          "(port 8000) only.")
    parentRefs: list[KubeObject] = Field(default_factory=list, description="Gateways.")
    hostnames: list[str] = Field(default_factory=list, description="Host names.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class OperatorPeer(_Values):
    namespaceSelector: KubeObject = Field(
        default_factory=lambda: {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
        description="Where the KubeRay operator runs: it alone may reach the head's dashboard "
        "(8265) and its agent (52365), through which it deploys serveConfigV2.")
    podSelector: KubeObject = Field(
        default_factory=lambda: {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        description="The operator's pods.")


class NetworkPolicy(_Values):
    enabled: bool = Field(True, description="NetworkPolicies: Redis only from this release's "
                          "Ray pods; the Ray dashboard only from the KubeRay operator; Ray's "
                          "other ports only within the release; the API from networkPolicy.apiFrom.")
    apiFrom: list[KubeObject] = Field(default_factory=list, description="Peers allowed to reach "
                                      "the API (port 8000); empty: any.")
    metricsFrom: list[KubeObject] = Field(
        default_factory=list, description="Peers allowed to scrape metrics (Ray's 8080, "
        "fairserve's fairserve.router.api.metrics_port), e.g. the monitoring namespace; empty: "
        "any. The tenants' API port never serves them.")
    adminFrom: list[KubeObject] = Field(
        default_factory=list, description="Peers allowed to reach the admin API "
        "(fairserve.router.api.admin_port); empty: the pods of the release's namespace only.")
    kuberayOperator: OperatorPeer = Field(default_factory=OperatorPeer)


class PodMonitor(_Values):
    enabled: bool = Field(False, description="A PodMonitor (Prometheus Operator) for the Ray "
                          "pods' metrics port (8080) and fairserve's own (fs-metrics, "
                          "fairserve.router.api.metrics_port).")
    interval: str = Field("15s", description="Scrape interval.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels (to match "
                                   "your Prometheus's selector).")


class Dashboards(_Values):
    enabled: bool = Field(False, description="The Grafana dashboard "
                          "(deploy/grafana/fairserve-dashboard.json) as a ConfigMap.")
    labels: dict[str, str] = Field(default_factory=lambda: {"grafana_dashboard": "1"},
                                   description="Labels for Grafana's dashboard sidecar.")


class PrometheusRule(_Values):
    enabled: bool = Field(False, description="Alert rules (Prometheus Operator): Redis near "
                          "its maxmemory, requests refused because it is full.")
    memoryRatio: float = Field(0.85, gt=0, lt=1, description="Warn when Redis's used memory "
                               "passes this share of its maxmemory for 5 minutes.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels (to match "
                                   "your Prometheus's rule selector).")


class Metrics(_Values):
    podMonitor: PodMonitor = Field(default_factory=PodMonitor)
    prometheusRule: PrometheusRule = Field(default_factory=PrometheusRule)
    dashboards: Dashboards = Field(default_factory=Dashboards)


class Preflight(_Values):
    requireKubeRayCRDs: bool = Field(True, description="Fail the install when the cluster has "
                                     "no KubeRay RayService CRD. Off for `helm template` and "
                                     "GitOps tools, which know only the built-in API groups.")


class HelmTest(_Values):
    enabled: bool = Field(True, description="`helm test` runs a pod that lists the models.")
    existingSecret: str = Field("", description="Secret with a tenant's API key (key "
                                "`api-key`); empty: the test checks that a request without a "
                                "key gets 401.")


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                  "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                        "seccompProfile": {"type": "RuntimeDefault"}}


class ChartValues(_Values):
    global_: Global = Field(default_factory=Global, alias="global")
    nameOverride: str = Field("", description="Override the chart name part of resource names.")
    fullnameOverride: str = Field("", description="Override the whole name prefix (at most 63 "
                                  "characters; the RayService takes 47).")
    image: Image = Field(default_factory=Image)
    gpuImage: GpuImage = Field(default_factory=GpuImage)
    imagePullSecrets: list[str] = Field(default_factory=list, description="Image pull secrets "
                                        "(names) for every pod.")
    fairserve: FairserveValues = Field(
        default_factory=FairserveValues, description="The fairserve settings tree "
        "(cluster/settings.py), one to one: it becomes the Serve application's args in "
        "serveConfigV2, so a change here is an in-place Serve update, never a new Ray cluster. "
        "The chart owns engine.model (model.*), engine.device (from replicas.num_gpus), the "
        "router's host and port, and the custom Ray resources.")
    model: Model = Field(default_factory=Model)
    ray: Ray = Field(default_factory=Ray)
    gcsFaultTolerance: GcsFaultTolerance = Field(default_factory=GcsFaultTolerance)
    upgrade: Upgrade = Field(default_factory=Upgrade)
    redis: Redis = Field(default_factory=Redis)
    tenants: Tenants = Field(default_factory=Tenants)
    admin: Admin = Field(default_factory=Admin)
    telemetry: Telemetry = Field(default_factory=Telemetry)
    ingress: Ingress = Field(default_factory=Ingress)
    httpRoute: HttpRoute = Field(default_factory=HttpRoute)
    networkPolicy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    metrics: Metrics = Field(default_factory=Metrics)
    podSecurityContext: KubeObject = Field(default_factory=lambda: dict(RESTRICTED_POD),
                                           description="Pod security context of every pod "
                                           "(the restricted Pod Security Standard).")
    securityContext: KubeObject = Field(default_factory=lambda: dict(RESTRICTED_CONTAINER),
                                        description="Security context of every container, the "
                                        "Ray ones included.")
    preflight: Preflight = Field(default_factory=Preflight)
    helmTest: HelmTest = Field(default_factory=HelmTest)
    extraObjects: list[KubeObject] = Field(default_factory=list, description="Extra objects "
                                           "rendered with the release (templated).")


# ---- values.yaml and values.schema.json, written from the models ----

HEADER = """\
# fairserve Helm chart values. Generated by helm/chart_values.py (`make helm-values`) from the
# typed models there, with values.schema.json: edit the models, not this file. A value that the
# schema does not know, of the wrong type or out of bounds, is refused by Helm with its path.
# The `fairserve:` branch is the settings tree of cluster/settings.py, one to one.
"""


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in getattr(annotation, "__args__", ())
              if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _comment(text: str, pad: str) -> list[str]:
    wrapped = textwrap.wrap(text, WIDTH - len(pad) - 5)
    return [f"{pad}# -- {wrapped[0]}"] + [f"{pad}# {line}" for line in wrapped[1:]]


def _scalar(value: Any) -> str:
    if value in ({}, []):
        return json.dumps(value)
    import yaml

    return str(yaml.safe_dump(value, default_flow_style=True, width=10_000)).strip().removesuffix(
        "\n...").removesuffix("...").strip()


def _block(value: Any, pad: str) -> list[str]:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=False, sort_keys=False, width=WIDTH)
    return [f"{pad}{line}" for line in text.rstrip("\n").splitlines()]


def _lines(model: type[BaseModel], data: dict[str, Any], indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        value = data[key]
        if info.description:
            out += _comment(info.description, pad)
        sub = _model_of(info.annotation)
        item = _model_of(getattr(info.annotation, "__args__", (None,))[0]) \
            if getattr(info.annotation, "__origin__", None) is list else None
        if sub is not None and isinstance(value, dict):
            out.append(f"{pad}{key}:")
            out += _lines(sub, value, indent + 2)
        elif item is not None and value:
            out.append(f"{pad}{key}:")
            for element in value:
                body = _lines(item, element, indent + 4)
                out.append(f"{pad}  - {body[0].lstrip()}")
                out += body[1:]
        elif isinstance(value, dict | list) and value:
            out.append(f"{pad}{key}:")
            out += _block(value, pad + "  ")
        else:
            out.append(f"{pad}{key}: {_scalar(value)}")
    return out


def values_yaml() -> str:
    data = ChartValues().model_dump(by_alias=True, mode="json")
    return HEADER + "\n" + "\n".join(_lines(ChartValues, data, 0)) + "\n"


def _strip_titles(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_titles(v) for k, v in node.items()
                if not (k == "title" and isinstance(v, str))}
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def values_schema() -> str:
    schema = _strip_titles(ChartValues.model_json_schema(by_alias=True, mode="validation"))
    document = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                "description": "Values of the fairserve Helm chart (helm/chart_values.py).",
                **schema}
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def undocumented(model: type[BaseModel] = ChartValues, where: str = "") -> list[str]:
    """Paths of fields with no description (every value is documented)."""
    missing = []
    for name, info in model.model_fields.items():
        path = f"{where}{info.alias or name}"
        sub = _model_of(info.annotation)
        item = _model_of(getattr(info.annotation, "__args__", (None,))[0]) \
            if getattr(info.annotation, "__origin__", None) is list else None
        if not info.description and sub is None and item is None:
            missing.append(path)
        for nested in (sub, item):
            if nested is not None:
                missing += undocumented(nested, f"{path}.")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args()
    stale = []
    for path, text in ((VALUES_FILE, values_yaml()), (SCHEMA_FILE, values_schema())):
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("stale (run python helm/chart_values.py): " + ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
