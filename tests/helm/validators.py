"""Offline validators for the rendered Helm chart: each takes manifests parsed with
`yaml.safe_load_all` and returns a list of problems (empty = fine), so a test reads
`assert not problems, problems`. Nothing here reaches the network.

- builtin_problems: built-in kinds, kubernetes-validate's strict schemas (custom resources skipped);
- rayservice_crd_problems: the RayService against its CRD schema, made strict;
- pod_templates / pod_template_problems: the Ray head and worker pod templates, which no
  built-in validator sees inside the RayService, wrapped as PodTemplates;
- kuberay_rule_problems, kuberay_cluster_hash, rebuilds_cluster: KubeRay's controller (kuberay_rules);
- security_problems: the security walk over every container, Ray's included;
- checkov_problems: checkov, run offline in its own virtual environment.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

from tests.helm.kuberay_rules import (
    ClusterAction,
    canonical_quantity,
    cluster_config,
    cluster_update_action,
    kuberay_cluster_hash,
    kuberay_rule_problems,
    load_crd_schema,
    pod_spec,
    ray_container,
    ray_groups,
    rebuilds_cluster,
)

__all__ = [
    "CheckovReport", "ClusterAction", "builtin_problems", "canonical_quantity", "checkov_problems",
    "cluster_update_action", "is_builtin", "is_secret_name", "kuberay_cluster_hash",
    "kuberay_rule_problems", "pod_template_problems", "pod_templates", "rayservice_crd_problems",
    "rebuilds_cluster", "secret_text_problems", "security_problems",
]

# --- Built-in kinds: kubernetes-validate, in process ---------------------------------------------


def _where(doc: dict) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def _path(path: Any) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return text.lstrip(".") or "(root)"


def _schema_version(k8s_version: str) -> str:
    """The bundled schema set kubernetes-validate picks: the newest not newer than asked."""
    wanted = tuple(int(p) for p in k8s_version.lstrip("v").split(".")[:2])
    usable = [v for v in kv_utils.all_versions() if tuple(int(p) for p in v.split(".")[:2]) <= wanted]
    if not usable:
        raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {k8s_version}")
    return usable[-1]


@functools.lru_cache(maxsize=8)
def _builtin_groups(k8s_version: str) -> frozenset[str]:
    """API groups served by Kubernetes itself ("" is core), read from the bundled definitions."""
    folder = f"v{_schema_version(k8s_version)}-local-strict"
    path = resources.files("kubernetes_validate") / "kubernetes-json-schema" / folder / "_definitions.json"
    definitions = json.loads(path.read_text())["$defs"]
    return frozenset(gvk["group"] for schema in definitions.values()
                     for gvk in schema.get("x-kubernetes-group-version-kind", []))


def is_builtin(doc: dict, k8s_version: str = "1.32.0") -> bool:
    """True for built-in kinds; False for custom resources (ray.io, monitoring.coreos.com,
    gateway.networking.k8s.io, ...), which kubernetes-validate has no schema for."""
    group = str(doc.get("apiVersion", "")).rpartition("/")[0]
    return group in _builtin_groups(k8s_version)


def builtin_problems(docs: list[Any], k8s_version: str = "1.32.0") -> list[str]:
    """Every built-in object against kubernetes-validate's strict schemas (unknown fields fail).
    A missing schema (kubernetes-validate's WARN, which exits 0) is a problem too: a built-in
    group with an unknown kind or version. Reports the first error of each object."""
    problems = []
    for doc in docs:
        if doc is None:
            continue  # an empty YAML document
        if not isinstance(doc, dict) or not doc.get("apiVersion") or not doc.get("kind"):
            problems.append(f"not a Kubernetes object (no apiVersion/kind): {str(doc)[:80]}")
            continue
        if not is_builtin(doc, k8s_version):
            continue
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{_where(doc)}: {_path(error.path)}: {error.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as error:
            problems.append(f"{_where(doc)}: {error.message}")
    return problems


# --- The RayService against its CRD, made strict --------------------------------------------------

_INT_OR_STRING = "x-fairserve-int-or-string"
_CEL_IN_LIST = re.compile(r"^\s*self\s+in\s+(\[.*\])\s*$", re.S)


def _strict(node: dict) -> dict:
    """A copy of a CRD schema node, stricter in the ways the API server is not:
    `additionalProperties: false` wherever `properties` are listed and unknown fields are not
    kept (the API server prunes them silently); int-or-string nodes become one keyword with a
    clear message; `nullable` becomes a null type; CEL `self in [...]` becomes an enum (the
    transition rules, `self == oldSelf`, need the old object and are left out)."""
    node = dict(node)
    if "properties" in node:
        node["properties"] = {name: _strict(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _strict(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = _strict(node["items"])
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("anyOf", None)
        node[_INT_OR_STRING] = {"pattern": node.pop("pattern", None)}
    if node.get("nullable") and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]
    for rule in node.get("x-kubernetes-validations") or []:
        match = _CEL_IN_LIST.match(rule.get("rule", ""))
        if match:
            node["enum"] = ast.literal_eval(match.group(1))
    return node


def _check_int_or_string(validator: Any, options: dict, instance: Any, schema: dict) -> Iterator[Any]:
    if isinstance(instance, bool) or not isinstance(instance, (int, str)):
        hint = (" (quote it: a CRD refuses a number with a fraction here, cloudnative-pg#1572)"
                if isinstance(instance, float) else "")
        yield jsonschema.ValidationError(f"{instance!r} must be an integer or a string{hint}")
    elif options["pattern"] and isinstance(instance, str) and not re.search(options["pattern"], instance):
        yield jsonschema.ValidationError(f"{instance!r} is not a Kubernetes quantity")


_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("int32")
def _is_int32(value: Any) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _is_int64(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@functools.lru_cache(maxsize=4)
def _crd_validator(version: str) -> Any:
    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, {_INT_OR_STRING: _check_int_or_string})
    return cls(_strict(load_crd_schema(version)), format_checker=_FORMATS)


def rayservice_crd_problems(rayservice: dict) -> list[str]:
    """The RayService against `openAPIV3Schema` of ../shared/crds/ray.io_rayservices.yaml, made
    strict (see `_strict`): a typo such as `rayStartParam:` is a problem here, where the API
    server would drop it. Defaults are not filled in, so required fields must be rendered."""
    group, _, version = str(rayservice.get("apiVersion", "")).rpartition("/")
    if group != "ray.io" or rayservice.get("kind") != "RayService":
        return [f"{_where(rayservice)} is not a ray.io RayService ({rayservice.get('apiVersion')})"]
    try:
        validator = _crd_validator(version)
    except KeyError as error:
        return [f"{_where(rayservice)}: {error.args[0]}"]
    errors = sorted(validator.iter_errors(rayservice), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_where(rayservice)}: {_path(e.absolute_path)}: {e.message}" for e in errors]


# --- The Ray pod templates as PodTemplates --------------------------------------------------------

# checkov's probe checks contradict KubeRay, which adds its own probes only when the Ray
# container has none (common/pod.go initLivenessAndReadinessProbe); kuberay_rule_problems
# forbids them there. So the wrappers carry checkov's per-resource skip annotation for these.
RAY_POD_TEMPLATE_CHECKOV_SKIPS = {
    "CKV_K8S_8": "KubeRay injects the liveness probe of the Ray container",
    "CKV_K8S_9": "KubeRay injects the (Serve-aware) readiness probe of the Ray container",
}


def pod_templates(rayservice: dict) -> list[dict]:
    """The head's and each worker group's pod `template` as a v1 PodTemplate named
    `<rayservice>-head` / `<rayservice>-worker-<group>`, in the RayService's namespace."""
    metadata = rayservice.get("metadata") or {}
    annotations = {f"checkov.io/skip{i}": f"{check}={reason}"
                   for i, (check, reason) in enumerate(RAY_POD_TEMPLATE_CHECKOV_SKIPS.items(), start=1)}
    wrapped = []
    for where, group in ray_groups(rayservice):
        suffix = "head" if where == "head" else f"worker-{group.get('groupName')}"
        wrapper_metadata = {"name": f"{metadata.get('name')}-{suffix}", "annotations": dict(annotations)}
        if metadata.get("namespace"):
            wrapper_metadata["namespace"] = metadata["namespace"]
        wrapped.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": wrapper_metadata,
                        "template": group.get("template") or {}})
    return wrapped


def pod_template_problems(rayservice: dict, k8s_version: str = "1.32.0") -> list[str]:
    """The Ray pod templates through builtin_problems (strict core/v1 PodTemplateSpec)."""
    return builtin_problems(pod_templates(rayservice), k8s_version)


# --- Security walk ---------------------------------------------------------------------------------
#
# Heuristics for secrets, kept simple on purpose (a false positive is fixed by renaming or by
# moving the value into a Secret; there is no opt-out):
#   - a name is secret-looking when one of its words (split at _ - . and camelCase) is
#     PASSWORD, PASSWD, TOKEN, KEY, SECRET, APIKEY or CREDENTIALS; for serveConfigV2 keys KEY
#     alone does not count (cache_key), API followed by KEY does (api_key);
#   - a value is an expansion, and fine, when it starts with $ ($(NAME) in Kubernetes, ${NAME}
#     or $(command) in a shell; Ray expands ${NAME} in runtime_env env_vars), or a file path
#     when it starts with /;
#   - in command/args (joined with spaces) and ConfigMap data: `requirepass X` or `masterauth X`
#     (Redis), `--<secret-looking option> X` or `--<option>=X` whose last word is secret-looking,
#     `NAME=X` with a secret-looking NAME, and credentials in a URL (scheme://user:X@host),
#     each where X is a literal (neither an expansion nor a path).

_SECRET_WORDS = frozenset({"PASSWORD", "PASSWD", "TOKEN", "KEY", "SECRET", "APIKEY", "CREDENTIALS"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")
_POD_TEMPLATE_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController")
# common/pod.go BuildAutoscalerContainer: what the autoscaler sidecar gets unless autoscalerOptions says.
_AUTOSCALER_DEFAULT_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"},
                                 "limits": {"cpu": "500m", "memory": "512Mi"}}


def _words(name: str) -> list[str]:
    return [w.upper() for w in _WORD.findall(str(name))]


def is_secret_name(name: str, config_key: bool = False) -> bool:
    words = _words(name)
    if config_key:
        return bool(set(words) & (_SECRET_WORDS - {"KEY"})) or "API_KEY" in "_".join(words)
    return bool(set(words) & _SECRET_WORDS)


def _is_literal(value: str) -> bool:
    """A value written down, not an expansion (``$VAR``, ``$(VAR)``), a file path or a printf
    placeholder (``%s``, filled from the environment at run time)."""
    value = value.strip().strip("\"'\\")
    return bool(value) and not value.startswith(("$", "/", "%"))


def secret_text_problems(text: str) -> list[str]:
    """Secret-looking literals in a command line or a config file (see the heuristics above)."""
    candidates = []  # (what was found, the value that must not be a literal)
    for match in re.finditer(r"\b(?:--)?(?:requirepass|masterauth)\s+(\S+)", text):
        candidates.append((match.group(0), match.group(1)))
    for match in re.finditer(r"(--[\w.-]+)(?:=|\s+)([^\s-]\S*)", text):
        if set(_words(match.group(1))[-1:]) & _SECRET_WORDS:
            candidates.append((match.group(0), match.group(2)))
    for match in re.finditer(r"(?<![\w-])([A-Za-z_]\w*)=(\S+)", text):
        if is_secret_name(match.group(1)):
            candidates.append((match.group(0), match.group(2)))
    for match in re.finditer(r"\w+://[^/\s:@]*:([^@\s/]+)@", text):
        candidates.append((match.group(0), match.group(1)))
    return [f"secret-looking literal {found!r}" for found, value in dict.fromkeys(candidates)
            if _is_literal(value)]


def _pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(location, pod spec) for every pod spec in one manifest; the RayService's head spec
    gains the autoscaler sidecar that KubeRay adds from autoscalerOptions."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind in _POD_TEMPLATE_KINDS:
        return [(_where(doc), pod_spec(spec))]
    if kind == "CronJob":
        return [(_where(doc), pod_spec((spec.get("jobTemplate") or {}).get("spec") or {}))]
    if kind == "Pod":
        return [(_where(doc), spec)]
    if kind == "PodTemplate":
        return [(_where(doc), pod_spec(doc))]
    if kind not in ("RayService", "RayCluster"):
        return []
    rayservice = doc if kind == "RayService" else {"spec": {"rayClusterConfig": spec}}
    cluster = cluster_config(rayservice)
    specs = [(f"{_where(doc)} {where}", pod_spec(group)) for where, group in ray_groups(rayservice)]
    if cluster.get("enableInTreeAutoscaling") is True and specs:
        options = cluster.get("autoscalerOptions") or {}
        sidecar = {"name": "autoscaler (autoscalerOptions)",
                   "image": options.get("image") or ray_container(cluster.get("headGroupSpec") or {}).get("image"),
                   "resources": options.get("resources") or _AUTOSCALER_DEFAULT_RESOURCES,
                   **{k: options[k] for k in ("securityContext", "env", "command", "args") if k in options}}
        head_where, head_spec = specs[0]
        specs[0] = (head_where, {**head_spec, "containers": [*(head_spec.get("containers") or []), sidecar]})
    return specs


def _image_problem(image: Any) -> str | None:
    if not image:
        return "has no image"
    name, _, digest = str(image).partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.partition(":")[2]
    if tag == "latest":
        return f"image {image!r} uses the latest tag"
    if not tag and not digest:
        return f"image {image!r} has neither a tag nor a digest"
    return None


def _security_context_problems(container: dict, pod_context: dict) -> list[str]:
    context = container.get("securityContext") or {}
    capabilities = context.get("capabilities") or {}
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
    problems = []
    if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
        problems.append("runAsNonRoot is not true")
    if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
        problems.append("runs as uid 0")
    if context.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation is not false")
    if context.get("privileged") is True:
        problems.append("is privileged")
    if "ALL" not in (capabilities.get("drop") or []):
        problems.append("capabilities.drop does not contain ALL")
    if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
        problems.append(f"adds capabilities {capabilities['add']}")
    if seccomp != "RuntimeDefault":
        problems.append(f"seccompProfile.type is {seccomp!r}, not 'RuntimeDefault'")
    return problems


def _container_problems(container: dict, pod_context: dict) -> list[str]:
    problems = _security_context_problems(container, pod_context)
    resources = container.get("resources") or {}
    problems += [f"has no {kind} for {name}" for kind in ("requests", "limits")
                 for name in ("cpu", "memory") if name not in (resources.get(kind) or {})]
    image_problem = _image_problem(container.get("image"))
    problems += [image_problem] if image_problem else []
    for variable in container.get("env") or []:
        if is_secret_name(variable.get("name", "")) and _is_literal(str(variable.get("value", ""))):
            problems.append(f"env {variable['name']} has a literal value; use valueFrom.secretKeyRef")
        elif is_secret_name(variable.get("name", "")) and "configMapKeyRef" in (variable.get("valueFrom") or {}):
            problems.append(f"env {variable['name']} comes from a ConfigMap; use a Secret")
    command_line = " ".join(str(part) for part in (container.get("command") or []) + (container.get("args") or []))
    return problems + secret_text_problems(command_line)


def _serve_config_problems(where: str, serve_config: Any) -> list[str]:
    """Secrets in serveConfigV2: it is plain text in the CR and on the Ray dashboard."""
    try:
        config = yaml.safe_load(serve_config) if isinstance(serve_config, str) else serve_config
    except yaml.YAMLError as error:
        return [f"{where}: serveConfigV2 is not valid YAML: {error}"]
    problems = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                inside_env = path.endswith("runtime_env.env_vars")
                if isinstance(value, str) and _is_literal(value) and is_secret_name(key, config_key=not inside_env):
                    problems.append(f"{where}: serveConfigV2 {path}.{key} holds a literal secret")
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, f"{path}[{index}]")
        elif isinstance(node, str):
            problems.extend(f"{where}: serveConfigV2 {path}: {p}" for p in secret_text_problems(node))

    walk(config, "")
    return problems


def _rayservice_secret_problems(doc: dict) -> list[str]:
    where = _where(doc)
    cluster = cluster_config(doc)
    problems = _serve_config_problems(where, (doc.get("spec") or {}).get("serveConfigV2") or "")
    password = (cluster.get("gcsFaultToleranceOptions") or {}).get("redisPassword") or {}
    if password.get("value"):
        problems.append(f"{where}: gcsFaultToleranceOptions.redisPassword.value is a literal; use valueFrom")
    for group_where, group in ray_groups(doc):
        problems += [f"{where} {group_where}: rayStartParams[{k!r}] holds a literal secret"
                     for k, v in (group.get("rayStartParams") or {}).items()
                     if is_secret_name(k) and isinstance(v, str) and _is_literal(v)]
    return problems


def security_problems(docs: list[Any]) -> list[str]:
    """The security walk over every container and initContainer of every pod spec (Deployment,
    StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, Pod, PodTemplate, and the RayService's
    head and worker templates plus its autoscaler sidecar): securityContext (runAsNonRoot,
    allowPrivilegeEscalation false, drop ALL, seccomp RuntimeDefault; pod level counts for
    runAsNonRoot/seccomp), cpu/memory requests and limits, pinned images, no literal secrets in
    env, command/args, ConfigMaps, serveConfigV2, rayStartParams or gcsFaultToleranceOptions."""
    problems = []
    for doc in (d for d in docs if isinstance(d, dict)):
        for where, spec in _pod_specs(doc):
            pod_context = spec.get("securityContext") or {}
            for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
                label = f"{where} container {container.get('name')!r}"
                problems += [f"{label}: {p}" for p in _container_problems(container, pod_context)]
        if doc.get("kind") == "RayService":
            problems += _rayservice_secret_problems(doc)
        if doc.get("kind") == "ConfigMap":
            for key, value in (doc.get("data") or {}).items():
                if is_secret_name(key) and _is_literal(str(value)):
                    problems.append(f"{_where(doc)}: data key {key!r} holds a literal secret; use a Secret")
                problems += [f"{_where(doc)} {key}: {p}" for p in secret_text_problems(str(value))]
    return problems


# --- checkov, offline ------------------------------------------------------------------------------
#
# checkov cannot live in the project's venv (it pins packaging<24, which breaks Ray); it runs
# from its own: python3 -m venv /tmp/checkov-venv && /tmp/checkov-venv/bin/pip install checkov==3.3.30
# What would reach the network otherwise (read in checkov 3.3.30's source):
#   - common/util/banner.py calls check_for_update (pypi.org) when main.py is imported, unless
#     CKV_SKIP_PACKAGE_UPDATE_CHECK is true;
#   - main.py calls bc_integration.get_platform_run_config(), which downloads the policy
#     mappings and guidelines (api0.prismacloud.io), unless --skip-download or BC_SKIP_MAPPING;
#   - an API key (BC_API_KEY, --bc-api-key) turns on the platform upload: the child gets a
#     minimal environment, so no key, proxy or CKV_* setting leaks in.
# HOME and the working directory are a fresh empty folder, so no ~/.checkov.yaml is read; a
# .checkov.yaml inside `directory` still is (checkov reads the scanned directory's own).
# `--quiet` is left out: with it the JSON report drops passed_checks, and checks_run needs them.

CHECKOV_OFFLINE_ENV = {"CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE",
                       "LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class CheckovReport:
    problems: list[str]  # one per failed check and resource, plus parse errors
    checks_run: list[str]  # ids of the checks that passed or failed at least once
    skipped: list[str]  # "<check id> <resource>: <reason>" for each skip that applied
    resource_count: int


def checkov_problems(directory: str | Path, checkov_bin: str | Path,
                     config_file: str | Path | None = None, timeout_s: float = 300) -> CheckovReport:
    """Run checkov's Kubernetes framework over `directory` (with `config_file` as
    --config-file, e.g. the chart's .checkov.yaml) and report its failed checks."""
    checkov_bin = Path(checkov_bin).resolve()  # checkov runs in a directory of its own
    command = [str(checkov_bin), "--framework", "kubernetes", "-d", str(directory),
               "--output", "json", "--compact", "--skip-download"]
    if config_file is not None:
        command += ["--config-file", str(config_file)]
    with tempfile.TemporaryDirectory(prefix="checkov-home-") as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, **CHECKOV_OFFLINE_ENV}
        run = subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=timeout_s)
    if run.returncode not in (0, 1):  # 1 = some check failed
        raise RuntimeError(f"checkov exited {run.returncode}: {run.stderr[-2000:]}")
    reports = json.loads(run.stdout)
    problems, checks_run, skipped, resource_count = [], set(), [], 0
    for report in reports if isinstance(reports, list) else [reports]:
        results = report.get("results") or {}  # absent when nothing was scanned
        summary = report.get("summary", report)
        resource_count += summary.get("resource_count", 0)
        problems += [f"checkov could not parse {path}" for path in results.get("parsing_errors", [])]
        for check in results.get("failed_checks", []):
            problems.append(f"{check['check_id']} ({check['check_name']}): "
                            f"{check['resource']} in {check['file_path']}")
        for check in results.get("skipped_checks", []):
            reason = (check.get("check_result") or {}).get("suppress_comment", "")
            skipped.append(f"{check['check_id']} {check['resource']}: {reason}")
        checks_run |= {c["check_id"] for c in results.get("passed_checks", []) + results.get("failed_checks", [])}
    return CheckovReport(problems, sorted(checks_run), skipped, resource_count)
