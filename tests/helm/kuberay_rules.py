"""KubeRay's view of a rendered RayService: the controller rules that its CRD schema does not
encode, and the cluster hash that decides whether a change rebuilds the Ray cluster.

Everything here was read from ray-project/kuberay at commit feeaf72f (the v1.7.0 line; master
differs from the v1.7.0 tag only in `KUBERAY_VERSION`), the commit the CRDs in ../shared/crds
come from. Each rule cites the Go function it mirrors; "fairserve:" marks rules that are
stricter than the controller, with the reason. Paths are relative to `ray-operator/`.

NOTE: the controller stops at the first error (`ValidateRayServiceSpec` returns early); these
functions report every problem at once, so a test shows all of them.
"""

from __future__ import annotations

import base64
import copy
import enum
import functools
import hashlib
import json
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

# ../shared/crds beside the checkout (CI has it there too); not copied into the project.
CRD_DIR = Path(__file__).resolve().parents[3] / "shared" / "crds"
RAYSERVICE_CRD = CRD_DIR / "ray.io_rayservices.yaml"

# controllers/ray/utils/constant.go: MaxRayServiceNameLength = MaxRayClusterNameLength(53) - 6,
# because GenerateRayClusterName appends "-" and 5 random characters.
MAX_RAYSERVICE_NAME_LENGTH = 47
# constant.go RayContainerIndex: "the Ray container must be the first application container".
RAY_CONTAINER_INDEX = 0
# The names KubeRay's samples and helm-chart/ray-cluster give the Ray container.
HEAD_RAY_CONTAINER = "ray-head"
WORKER_RAY_CONTAINER = "ray-worker"
UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
# constant.go names of the env vars and annotations the rules look at.
RAY_REDIS_ADDRESS = "RAY_REDIS_ADDRESS"
REDIS_PASSWORD = "REDIS_PASSWORD"
REDIS_USERNAME = "REDIS_USERNAME"
RAY_ENABLE_AUTOSCALER_V2 = "RAY_enable_autoscaler_v2"
KUBERAY_GEN_AUTOSCALER_START_CMD = "KUBERAY_GEN_AUTOSCALER_START_CMD"
FT_ENABLED_ANNOTATION = "ray.io/ft-enabled"
EXTERNAL_STORAGE_NS_ANNOTATION = "ray.io/external-storage-namespace"
INITIALIZING_TIMEOUT_ANNOTATION = "ray.io/initializing-timeout"
# common/pod.go: the memory-backed volume KubeRay adds to the Ray container (BuildPod).
SHARED_MEMORY_VOLUME = "shared-mem"
SHARED_MEMORY_PATH = "/dev/shm"

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_GO_DURATION = re.compile(r"^[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+$")
_GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


@functools.lru_cache(maxsize=1)
def _crd_schemas() -> dict[str, dict[str, Any]]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 14,000 lines
    crd = yaml.load(RAYSERVICE_CRD.read_text(), Loader=loader)
    return {entry["name"]: entry["schema"]["openAPIV3Schema"] for entry in crd["spec"]["versions"]}


def load_crd_schema(version: str = "v1") -> dict[str, Any]:
    """The RayService CRD's `openAPIV3Schema` for one API version (v1 or v1alpha1), read once."""
    if version not in _crd_schemas():
        raise KeyError(f"{RAYSERVICE_CRD.name} has no version {version!r}")
    return _crd_schemas()[version]


def cluster_config(rayservice: dict) -> dict:
    return (rayservice.get("spec") or {}).get("rayClusterConfig") or {}


def ray_groups(rayservice: dict) -> list[tuple[str, dict]]:
    """(label, group spec) for the head and each worker group, in order."""
    cluster = cluster_config(rayservice)
    groups = [("head", cluster.get("headGroupSpec") or {})]
    for index, group in enumerate(cluster.get("workerGroupSpecs") or []):
        groups.append((f"worker group {group.get('groupName', f'#{index}')!r}", group))
    return groups


def pod_spec(group: dict) -> dict:
    return ((group.get("template") or {}).get("spec")) or {}


def ray_container(group: dict) -> dict:
    containers = pod_spec(group).get("containers") or []
    return containers[RAY_CONTAINER_INDEX] if containers else {}


def _env(container: dict) -> dict[str, dict]:
    return {e.get("name"): e for e in container.get("env") or []}


def _is_autoscaling(cluster: dict) -> bool:  # utils/util.go IsAutoscalingEnabled
    return cluster.get("enableInTreeAutoscaling") is True


def _is_autoscaling_v2(cluster: dict) -> bool:  # utils/util.go IsAutoscalingV2Enabled
    return (cluster.get("autoscalerOptions") or {}).get("version") == "v2"


def _env_says_v2(cluster: dict) -> bool:
    value = (_env(ray_container(cluster.get("headGroupSpec") or {})).get(RAY_ENABLE_AUTOSCALER_V2) or {})
    return value.get("value") in ("1", "true")


def _version_at_least(text: str, minimum: tuple[int, int, int]) -> bool | None:
    """k8s.io/apimachinery version.ParseGeneric + LessThan; None when it does not parse."""
    match = _VERSION.match(str(text))
    if not match:
        return None
    return tuple(int(g or 0) for g in match.groups()) >= minimum


def _label_problems(where: str, labels: dict) -> list[str]:
    """validation.IsQualifiedName on keys and IsValidLabelValue on values."""
    problems = []
    for key, value in (labels or {}).items():
        prefix, _, name = str(key).rpartition("/")
        if (len(name) > 63 or not _LABEL_NAME.match(name)
                or ("/" in str(key) and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)))):
            problems.append(f"{where}: invalid label key {key!r}")
        if not isinstance(value, str) or len(value) > 63 or (value and not _LABEL_NAME.match(value)):
            problems.append(f"{where}: invalid label value {value!r} for key {key!r}")
    return problems


def _is_positive_timeout(text: str) -> bool:
    """validation.go validateInitializingTimeout: a Go duration (time.ParseDuration) or an
    integer number of seconds (strconv.Atoi), either of them > 0."""
    if _GO_DURATION.match(text):
        scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
        total = sum(float(n) * scale[unit] for n, unit in _GO_DURATION_PART.findall(text))
        return total > 0 and not text.startswith("-")
    return bool(re.fullmatch(r"[-+]?\d+", text)) and int(text) > 0


# --- ValidateRayServiceMetadata (utils/validation.go) -------------------------------------------


def _metadata_problems(rayservice: dict) -> list[str]:
    metadata = rayservice.get("metadata") or {}
    name = str(metadata.get("name", ""))
    problems = []
    if len(name) > MAX_RAYSERVICE_NAME_LENGTH:  # MaxRayServiceNameLength
        problems.append(f"RayService name {name!r} has {len(name)} characters; at most "
                        f"{MAX_RAYSERVICE_NAME_LENGTH} (KubeRay appends '-xxxxx' for the cluster)")
    if len(name) > 63 or not _DNS1035.match(name):  # validation.IsDNS1035Label
        problems.append(f"RayService name {name!r} is not a DNS-1035 label "
                        "(lower case, starts with a letter, ends with a letter or digit)")
    timeout = (metadata.get("annotations") or {}).get(INITIALIZING_TIMEOUT_ANNOTATION)
    if timeout and not _is_positive_timeout(str(timeout)):  # validateInitializingTimeout
        problems.append(f"annotation {INITIALIZING_TIMEOUT_ANNOTATION}={timeout!r} is neither a "
                        "positive Go duration nor a positive number of seconds")
    return problems


# --- ValidateRayServiceSpec and ValidateClusterUpgradeOptions (utils/validation.go) -------------


def _incremental_upgrade_problems(rayservice: dict) -> list[str]:
    """ValidateClusterUpgradeOptions; the RayServiceIncrementalUpgrade gate is on by default in
    v1.7 (pkg/features/features.go), so it applies whenever the type is chosen."""
    if not _is_autoscaling(cluster_config(rayservice)):
        return ["NewClusterWithIncrementalUpgrade requires enableInTreeAutoscaling: true"]
    options = ((rayservice.get("spec") or {}).get("upgradeStrategy") or {}).get("clusterUpgradeOptions")
    if options is None:
        return ["NewClusterWithIncrementalUpgrade requires upgradeStrategy.clusterUpgradeOptions"]
    problems = []
    surge = options.get("maxSurgePercent", 100)  # CRD default 100
    step = options.get("stepSizePercent")
    interval = options.get("intervalSeconds")
    if not 0 <= surge <= 100:
        problems.append(f"maxSurgePercent {surge} must be between 0 and 100")
    if step is None or not 0 <= step <= 100:
        problems.append(f"stepSizePercent {step} must be between 0 and 100")
    elif step > surge:
        problems.append(f"stepSizePercent {step} must be <= maxSurgePercent {surge}")
    # fairserve: 0 passes the controller but never moves traffic (rayservice_controller.go adds
    # StepSizePercent to the pending weight) or capacity (MaxSurgePercent), so the upgrade stalls.
    if step == 0 or surge == 0:
        problems.append("stepSizePercent and maxSurgePercent must be > 0 (0 stalls the upgrade)")
    if interval is None or interval <= 0:
        problems.append(f"intervalSeconds {interval} must be > 0")
    if not options.get("gatewayClassName"):
        problems.append("gatewayClassName is required for NewClusterWithIncrementalUpgrade")
    return problems


def _service_spec_problems(rayservice: dict) -> list[str]:
    spec = rayservice.get("spec") or {}
    cluster = cluster_config(rayservice)
    problems = []
    if (cluster.get("authOptions") or {}).get("enableK8sTokenAuth") is True:
        problems.append("authOptions.enableK8sTokenAuth is not supported for RayService")
    head_service = (cluster.get("headGroupSpec") or {}).get("headService") or {}
    if (head_service.get("metadata") or {}).get("name"):
        problems.append("headGroupSpec.headService.metadata.name must not be set (kuberay#2433)")
    upgrade_type = (spec.get("upgradeStrategy") or {}).get("type")
    if upgrade_type is not None and upgrade_type not in UPGRADE_TYPES:
        problems.append(f"upgradeStrategy.type {upgrade_type!r} is not one of {', '.join(UPGRADE_TYPES)}")
    delay = spec.get("rayClusterDeletionDelaySeconds")
    if delay is not None and delay < 0:
        problems.append(f"rayClusterDeletionDelaySeconds {delay} must be >= 0")
    if upgrade_type == "NewClusterWithIncrementalUpgrade":
        problems += _incremental_upgrade_problems(rayservice)
    # ValidateRayClusterUpgradeOptions: the RayCluster made by a RayService carries the label
    # ray.io/originated-from-crd=RayService, and then upgradeStrategy.type is refused.
    if (cluster.get("upgradeStrategy") or {}).get("type") is not None:
        problems.append("rayClusterConfig.upgradeStrategy.type cannot be set on a RayService's cluster")
    return problems


# --- ValidateRayClusterSpec (utils/validation.go) -----------------------------------------------


def _worker_replica_problems(where: str, group: dict, autoscaling: bool) -> list[str]:
    low, high, replicas = group.get("minReplicas"), group.get("maxReplicas"), group.get("replicas")
    problems = []
    # The controller requires both only without autoscaling; fairserve always renders both,
    # since an offline check does not fill the CRD defaults in (helm-notes 1.1).
    if low is None or high is None:
        problems.append(f"{where}: must set both minReplicas and maxReplicas"
                        + ("" if autoscaling else " when autoscaling is disabled"))
    for field, value in (("minReplicas", low), ("maxReplicas", high)):
        if isinstance(value, int) and value < 0:
            problems.append(f"{where}: negative {field} {value}")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append(f"{where}: minReplicas {low} is greater than maxReplicas {high}")
    # fairserve: utils/util.go GetWorkerGroupDesiredReplicas silently clamps replicas into range.
    if isinstance(replicas, int) and isinstance(low, int) and isinstance(high, int) \
            and not low <= replicas <= high:
        problems.append(f"{where}: replicas {replicas} is outside [{low}, {high}]")
    return problems


def _group_problems(cluster: dict) -> list[str]:
    autoscaling = _is_autoscaling(cluster)
    problems = []
    names = [g.get("groupName") for g in cluster.get("workerGroupSpecs") or []]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"worker group name {name!r} is used more than once")  # fairserve
    for where, group in ray_groups({"spec": {"rayClusterConfig": cluster}}):
        params = group.get("rayStartParams") or {}
        if not pod_spec(group).get("containers"):
            problems.append(f"{where}: the pod template has no containers")
        # validateRayGroupResources: "resources" here is the group's own `resources` map.
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) \
                and group.get("resources"):
            problems.append(f"{where}: resources are set both in rayStartParams and in `resources`")
        if "labels" in params:  # validateRayGroupLabels
            problems.append(f"{where}: rayStartParams['labels'] is not supported; use `labels`")
        problems += _label_problems(where, group.get("labels") or {})
        if where == "head":
            continue
        problems += _worker_replica_problems(where, group, autoscaling)
        idle = group.get("idleTimeoutSeconds")  # validateWorkerGroupIdleTimeout
        if idle is not None and idle < 0:
            problems.append(f"{where}: idleTimeoutSeconds {idle} must be >= 0")
        elif idle is not None and not (_is_autoscaling_v2(cluster) or _env_says_v2(cluster)):
            problems.append(f"{where}: idleTimeoutSeconds needs autoscalerOptions.version v2")
        problems += _priority_problems(where, group, cluster)
        if group.get("suspend") is True and autoscaling:
            problems.append(f"{where}: cannot be suspended with the autoscaler enabled")
    return problems


def _priority_problems(where: str, group: dict, cluster: dict) -> list[str]:
    """validateWorkerGroupPriority: priority needs Ray >= 2.56.0 and autoscaler v2."""
    if not group.get("priority"):
        return []
    recent = _version_at_least(cluster.get("rayVersion", ""), (2, 56, 0))
    if not recent:
        return [f"{where}: priority needs rayVersion >= 2.56.0"]
    if not (_is_autoscaling_v2(cluster) or _env_says_v2(cluster)):
        return [f"{where}: priority needs autoscalerOptions.version v2"]
    return []


def _gcs_ft_problems(cluster: dict, annotations: dict) -> list[str]:
    options = cluster.get("gcsFaultToleranceOptions")
    head = cluster.get("headGroupSpec") or {}
    env = _env(ray_container(head))
    params = head.get("rayStartParams") or {}
    ft_annotation = str(annotations.get(FT_ENABLED_ANNOTATION, "")).lower() == "true"
    problems = []
    if annotations.get(FT_ENABLED_ANNOTATION) and options is not None:
        problems.append(f"{FT_ENABLED_ANNOTATION} annotation and gcsFaultToleranceOptions are both set")
    if options is None and not ft_annotation and RAY_REDIS_ADDRESS in env:
        problems.append(f"head env {RAY_REDIS_ADDRESS} enables GCS FT implicitly; "
                        "use gcsFaultToleranceOptions")
    if params.get("redis-username") or REDIS_USERNAME in env:
        problems.append("redis username set in rayStartParams or env; "
                        "use gcsFaultToleranceOptions.redisUsername")
    if options is None:
        return problems
    if params.get("redis-password"):
        problems.append("rayStartParams redis-password is set with gcsFaultToleranceOptions")
    for name in (REDIS_PASSWORD, RAY_REDIS_ADDRESS):
        if name in env:
            problems.append(f"head env {name} is set with gcsFaultToleranceOptions")
    if annotations.get(EXTERNAL_STORAGE_NS_ANNOTATION):
        problems.append(f"annotation {EXTERNAL_STORAGE_NS_ANNOTATION} is set with gcsFaultToleranceOptions")
    # validateGcsFaultToleranceBackend: rocksdb needs the GCSFaultToleranceEmbeddedStorage gate,
    # off by default; redis (the default backend) refuses `storage`.
    if options.get("backend") == "rocksdb":
        problems.append("gcsFaultToleranceOptions.backend rocksdb needs a feature gate that is off by default")
    elif options.get("storage") is not None:
        problems.append("gcsFaultToleranceOptions.storage only applies to the rocksdb backend")
    return problems


def _autoscaler_problems(cluster: dict) -> list[str]:
    head_env = _env(ray_container(cluster.get("headGroupSpec") or {}))
    options = cluster.get("autoscalerOptions") or {}
    problems = []
    if not _is_autoscaling(cluster) and _env_says_v2(cluster):
        problems.append(f"head env {RAY_ENABLE_AUTOSCALER_V2} is set without enableInTreeAutoscaling")
    if _is_autoscaling(cluster) and options.get("version") is not None and RAY_ENABLE_AUTOSCALER_V2 in head_env:
        problems.append(f"both autoscalerOptions.version and head env {RAY_ENABLE_AUTOSCALER_V2} are set")
    if _is_autoscaling(cluster) and _is_autoscaling_v2(cluster):
        for where, group in ray_groups({"spec": {"rayClusterConfig": cluster}}):
            policy = pod_spec(group).get("restartPolicy")
            if policy not in (None, "", "Never"):
                problems.append(f"{where}: restartPolicy {policy!r} must be Never or unset with autoscaler v2")
    idle = options.get("idleTimeoutSeconds")
    if idle is not None and idle < 0:
        problems.append(f"autoscalerOptions.idleTimeoutSeconds {idle} must be >= 0")
    if KUBERAY_GEN_AUTOSCALER_START_CMD in _env(options):
        problems.append(f"autoscalerOptions.env must not set {KUBERAY_GEN_AUTOSCALER_START_CMD}")
    return problems


def _feature_problems(cluster: dict) -> list[str]:
    """Options behind feature gates that ship off (pkg/features/features.go) and the token-auth
    version floor (ValidateRayClusterSpec, IsAuthEnabled)."""
    problems = [f"{field} needs a KubeRay feature gate that is off by default"
                for field in ("historyServerOptions", "networkPolicy", "tlsOptions")
                if cluster.get(field) is not None]
    token_auth = (cluster.get("authOptions") or {}).get("mode") == "token"
    if token_auth and not _version_at_least(cluster.get("rayVersion", ""), (2, 52, 0)):
        problems.append("authOptions.mode token needs rayVersion >= 2.52.0")
    return problems


# --- What common/pod.go assumes of the Ray container (fairserve rules) --------------------------


def _ray_container_problems(rayservice: dict) -> list[str]:
    head_image = ray_container(cluster_config(rayservice).get("headGroupSpec") or {}).get("image")
    problems = []
    for where, group in ray_groups(rayservice):
        containers = pod_spec(group).get("containers") or []
        expected = HEAD_RAY_CONTAINER if where == "head" else WORKER_RAY_CONTAINER
        ray = containers[0] if containers else {}
        if containers and ray.get("name") != expected:
            problems.append(f"{where}: containers[0] is {ray.get('name')!r}; KubeRay takes index 0 "
                            f"as the Ray container, so {expected!r} must come first")
        for index, other in enumerate(containers[1:], start=1):
            if str(other.get("name", "")).startswith("ray-"):
                problems.append(f"{where}: Ray container {other.get('name')!r} at index {index}, not 0")
        # NOTE: the images may differ (a CPU head, CUDA workers, as KubeRay's own samples do);
        # Ray needs the same Ray and Python versions, which the fairserve images share
        if not ray.get("image") or not head_image:
            problems.append(f"{where}: the Ray container has no image")
        # initLivenessAndReadinessProbe adds KubeRay's (Serve-aware on workers) probes only
        # when none is set; a startupProbe has no KubeRay default and delays those probes.
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in ray:
                problems.append(f"{where}: the Ray container sets {probe}; KubeRay injects its own")
        params = group.get("rayStartParams") or {}
        problems += [f"{where}: rayStartParams[{k!r}] = {v!r} is not a string"
                     for k, v in params.items() if not isinstance(v, str)]
        if "plasma-directory" not in params:  # BuildPod skips /dev/shm only then
            problems += _shm_problems(where, group, ray)
    return problems


def _shm_problems(where: str, group: dict, ray: dict) -> list[str]:
    problems = []
    if any(m.get("mountPath") == SHARED_MEMORY_PATH for m in ray.get("volumeMounts") or []):
        problems.append(f"{where}: the Ray container mounts {SHARED_MEMORY_PATH}; KubeRay injects it, "
                        "sized from the memory request")
    if any(v.get("name") == SHARED_MEMORY_VOLUME for v in pod_spec(group).get("volumes") or []):
        problems.append(f"{where}: volume {SHARED_MEMORY_VOLUME!r} is KubeRay's /dev/shm volume")
    return problems


def kuberay_rule_problems(rayservice: dict) -> list[str]:
    """Every rule the KubeRay controller enforces on a RayService beyond its CRD schema
    (ValidateRayServiceMetadata, ValidateRayServiceSpec -> ValidateRayClusterSpec), plus what
    common/pod.go assumes of the Ray container. Empty when the controller would accept it."""
    annotations = (rayservice.get("metadata") or {}).get("annotations") or {}
    cluster = cluster_config(rayservice)
    return (_metadata_problems(rayservice) + _service_spec_problems(rayservice)
            + _group_problems(cluster) + _gcs_ft_problems(cluster, annotations)
            + _autoscaler_problems(cluster) + _feature_problems(cluster)
            + _ray_container_problems(rayservice))


# --- The cluster hash: does a change rebuild the Ray cluster? ------------------------------------
#
# NOTE: KubeRay writes GenerateHashWithoutReplicasAndWorkersToDelete(spec) (utils/util.go) into
# the annotation ray.io/hash-without-replicas-and-workers-to-delete of each RayCluster it builds
# from a RayService, and ray.io/num-worker-groups next to it (rayservice_controller.go
# constructRayClusterForRayService). On every reconcile it hashes the RayService's current
# rayClusterConfig (rayClusterSpecForHashing clears `suspend` first) and compares
# (isClusterSpecHashEqual, shouldUpdateCluster, shouldPrepareNewCluster):
#   equal hashes                                    -> nothing to do for the cluster;
#   equal once the new spec is cut to the old number
#   of worker groups (groups appended at the end)   -> the RayCluster is updated in place;
#   otherwise, if zero-downtime upgrade is enabled  -> a new RayCluster (blue/green);
#   otherwise (upgradeStrategy.type None, or
#   ENABLE_ZERO_DOWNTIME=false on the operator)     -> nothing: the change is never applied.
# The hash is sha1 over Go's json.Marshal of the typed RayClusterSpec, in base32hex.


class ClusterAction(enum.Enum):
    """What the RayService controller does with the RayCluster after a spec change."""

    NONE = "none"  # same hash; serveConfigV2 changes are still applied in place
    UPDATE_IN_PLACE = "update in place"  # only worker groups appended at the end
    NEW_CLUSTER = "new cluster"  # a second RayCluster, then the traffic switch
    NOT_APPLIED = "not applied"  # the cluster spec differs and is left as it was


def _release(kuberay_version: str) -> tuple[int, int]:
    major, minor = (int(p) for p in kuberay_version.split(".")[:2])
    if (major, minor) < (1, 5):
        raise ValueError(f"KubeRay {kuberay_version} is older than the 1.5 this module was checked against")
    return major, minor


def canonical_quantity(value: int | str) -> str | None:
    """resource.Quantity as Go marshals it after parsing (ParseQuantity, CanonicalizeBytes in
    k8s.io/apimachinery/pkg/api/resource/quantity.go): the suffix family is kept, the value is
    rounded up to 1n, the largest exact suffix wins: "1000m" -> "1", "1024Mi" -> "1Gi",
    "1.5Gi" -> "1536Mi", "1000" -> "1k", "1e3" -> "1e3". None when it does not parse."""
    match = _QUANTITY.match(str(value).strip())
    if isinstance(value, bool) or not match:
        return None
    sign, number, suffix = match.group(1), match.group(2), match.group(3) or ""
    if suffix[:1] in ("e", "E"):
        base, exponent, family = 10, int(suffix[1:]), "exponent"
    else:
        base, exponent = _SUFFIX_BASE[suffix]
        family = "binary" if base == 2 else "decimal"
    amount = Fraction(number) * Fraction(base) ** exponent * (-1 if sign == "-" else 1)
    exact_nanos = amount * 10**9
    nanos = math.ceil(exact_nanos) if exact_nanos > 0 else math.floor(exact_nanos)  # away from 0
    if nanos == 0:
        return "0"
    amount = Fraction(nanos, 10**9)
    if family == "binary" and (abs(amount) < 1024 or amount.denominator != 1):
        family = "decimal"  # CanonicalizeBytes: small or fractional binary values print as SI
    if family == "binary":
        units, power = abs(int(amount)), 0
        while units >= 1024 and units % 1024 == 0:
            units, power = units // 1024, power + 1
        return f"{'-' if amount < 0 else ''}{units}{('', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei')[power]}"
    mantissa, power = nanos, -9
    while abs(mantissa) >= 10 and mantissa % 10 == 0:
        mantissa, power = mantissa // 10, power + 1
    while power % 3:
        mantissa, power = mantissa * 10, power - 1
    if family == "exponent" or power not in _DECIMAL_SUFFIX:
        return f"{mantissa}" + (f"e{power}" if power else "")
    return f"{mantissa}{_DECIMAL_SUFFIX[power]}"


_QUANTITY = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)([numkMGTPE]|[KMGTPE]i|[eE][+-]?\d+)?$")
_SUFFIX_BASE = {"": (10, 0), "n": (10, -9), "u": (10, -6), "m": (10, -3), "k": (10, 3),
                "M": (10, 6), "G": (10, 9), "T": (10, 12), "P": (10, 15), "E": (10, 18),
                "Ki": (2, 10), "Mi": (2, 20), "Gi": (2, 30), "Ti": (2, 40), "Pi": (2, 50), "Ei": (2, 60)}
_DECIMAL_SUFFIX = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}


def _as_stored(value: Any, schema: dict) -> Any:
    """`value` as the controller sees it: CRD `default`s filled in (the API server's structural
    defaulting) and quantities in Go's canonical form (the typed decode)."""
    if isinstance(value, dict):
        properties = schema.get("properties")
        if properties:
            value = {**{k: copy.deepcopy(s["default"]) for k, s in properties.items()
                        if "default" in s and k not in value}, **value}
            return {k: _as_stored(v, properties.get(k, {})) for k, v in value.items()}
        extra = schema.get("additionalProperties")
        return {k: _as_stored(v, extra if isinstance(extra, dict) else {}) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_stored(v, schema.get("items") or {}) for v in value]
    if schema.get("x-kubernetes-int-or-string") and "pattern" in schema:  # a Quantity
        return canonical_quantity(value) or value
    return value


def _hashed_cluster_spec(rayservice: dict, kuberay_version: str) -> dict:
    """rayClusterConfig with what GenerateHashWithoutReplicasAndWorkersToDelete (and, since
    1.7, rayClusterSpecForHashing) mutes removed. 1.5 muted only replicas, min/maxReplicas
    and workersToDelete; 1.6 added tolerations, schedulingGates and upgradeStrategy."""
    version = str(rayservice.get("apiVersion", "ray.io/v1")).rpartition("/")[2]
    schema = load_crd_schema(version)["properties"]["spec"]["properties"]["rayClusterConfig"]
    spec = _as_stored(copy.deepcopy(cluster_config(rayservice)), schema)
    release = _release(kuberay_version)
    for worker in spec.get("workerGroupSpecs") or []:
        for field in ("replicas", "minReplicas", "maxReplicas"):
            worker.pop(field, None)
        # ScaleStrategy holds only workersToDelete; once muted, Go writes "scaleStrategy":{}
        # for every spec (encoding/json never omits a struct), so dropping it is exact.
        worker.pop("scaleStrategy", None)
    if release >= (1, 6):
        for _, group in ray_groups({"spec": {"rayClusterConfig": spec}}):
            pod_spec(group).pop("tolerations", None)
            pod_spec(group).pop("schedulingGates", None)
        spec.pop("upgradeStrategy", None)
    if release >= (1, 7):
        spec.pop("suspend", None)
    return spec


def kuberay_cluster_hash(rayservice: dict, kuberay_version: str = "1.7",
                         num_worker_groups: int | None = None) -> str:
    """KubeRay's hash of `rayClusterConfig`, decision-equivalent: two specs get equal hashes
    here exactly when they do in KubeRay, except that this one can also differ where Go's would
    not (never the reverse), so a test built on it errs towards "rebuilds":
      - a field written with its zero value ([], {}, "", false on a non-pointer field) and the
        same field left out hash alike in Go (omitempty, typed zero values), differently here;
      - unknown fields are pruned by the API server and absent from Go's struct, hashed here
        (rayservice_crd_problems refuses them anyway).
    What Go normalises is normalised here too: CRD defaults (e.g. ports' protocol TCP,
    numOfHosts 1) and quantities ("1000m" == "1"). The bytes differ from the annotation's
    (sorted keys instead of struct order), so compare hashes from this function only.
    `num_worker_groups` cuts the worker groups first, as isClusterSpecHashEqual(partial) does."""
    spec = _hashed_cluster_spec(rayservice, kuberay_version)
    if num_worker_groups is not None:
        spec["workerGroupSpecs"] = (spec.get("workerGroupSpecs") or [])[:num_worker_groups]
    if not spec.get("workerGroupSpecs"):
        spec.pop("workerGroupSpecs", None)  # `json:"workerGroupSpecs,omitempty"`
    data = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return base64.b32hexencode(hashlib.sha1(data.encode()).digest()).decode()  # GenerateJsonHash


def _zero_downtime_enabled(rayservice: dict, release: tuple[int, int], operator_zero_downtime: bool) -> bool:
    """rayservice_controller.go isZeroDowntimeUpgradeEnabled; the incremental-upgrade gate is
    on by default from 1.7 (off in 1.5 and 1.6, where that type then means no upgrade)."""
    upgrade_type = ((rayservice.get("spec") or {}).get("upgradeStrategy") or {}).get("type")
    if upgrade_type is None:
        return operator_zero_downtime  # the operator's ENABLE_ZERO_DOWNTIME env, default true
    allowed = ("NewCluster", "NewClusterWithIncrementalUpgrade") if release >= (1, 7) else ("NewCluster",)
    return upgrade_type in allowed


def cluster_update_action(old_rayservice: dict, new_rayservice: dict, kuberay_version: str = "1.7",
                          operator_zero_downtime: bool = True) -> ClusterAction:
    """What the controller does when `old_rayservice` (whose RayCluster exists) is changed to
    `new_rayservice`: see the NOTE above."""
    old_hash = kuberay_cluster_hash(old_rayservice, kuberay_version)
    if kuberay_cluster_hash(new_rayservice, kuberay_version) == old_hash:
        return ClusterAction.NONE
    old_groups = len(cluster_config(old_rayservice).get("workerGroupSpecs") or [])
    new_groups = len(cluster_config(new_rayservice).get("workerGroupSpecs") or [])
    if new_groups >= old_groups and old_hash == kuberay_cluster_hash(
            new_rayservice, kuberay_version, num_worker_groups=old_groups):
        return ClusterAction.UPDATE_IN_PLACE
    if _zero_downtime_enabled(new_rayservice, _release(kuberay_version), operator_zero_downtime):
        return ClusterAction.NEW_CLUSTER
    return ClusterAction.NOT_APPLIED


def rebuilds_cluster(old_rayservice: dict, new_rayservice: dict, kuberay_version: str = "1.7",
                     operator_zero_downtime: bool = True) -> bool:
    """True when the change makes KubeRay build a whole new RayCluster (twice the GPUs)."""
    action = cluster_update_action(old_rayservice, new_rayservice, kuberay_version, operator_zero_downtime)
    return action is ClusterAction.NEW_CLUSTER
