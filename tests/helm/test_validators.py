"""The chart validators on small hand-written manifests: every good manifest passes, and every
bad one is caught with the problem it is built to have (no test can pass on an empty list)."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm import kuberay_rules
from tests.helm.validators import (
    ClusterAction,
    builtin_problems,
    canonical_quantity,
    checkov_problems,
    cluster_update_action,
    is_builtin,
    kuberay_cluster_hash,
    kuberay_rule_problems,
    pod_template_problems,
    pod_templates,
    rayservice_crd_problems,
    rebuilds_cluster,
    secret_text_problems,
    security_problems,
)

# --- Factories: a hardened fairserve RayService and a hardened Deployment ------------------------

IMAGE = "ghcr.io/fairserve/fairserve:0.1.0"
HARDENED = {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
POD_CONTEXT = {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 100,
               "seccompProfile": {"type": "RuntimeDefault"}}
SERVE_CONFIG = """\
applications:
- name: router
  import_path: router.app:build
  route_prefix: /
  runtime_env:
    env_vars: {HF_TOKEN: "${HF_TOKEN}", FAIRSERVE_LOG_LEVEL: info, HF_TOKEN_PATH: /var/run/hf/token}
  args: {redis_url: "redis://:${REDIS_PASSWORD}@fairserve-redis:6379", max_tokens: 512}
  deployments:
  - {name: Router, max_ongoing_requests: 64, ray_actor_options: {num_cpus: 1}}
"""


def container(name: str, cpu: Any = "2", memory: Any = "8Gi", **extra: Any) -> dict:
    amounts = {"cpu": cpu, "memory": memory, **extra.pop("accelerators", {})}
    return {"name": name, "image": IMAGE, "securityContext": copy.deepcopy(HARDENED),
            "resources": {"requests": dict(amounts), "limits": dict(amounts)}, **extra}


def pod_template(*containers: dict, **spec: Any) -> dict:
    return {"metadata": {"labels": {"app.kubernetes.io/name": "fairserve"}},
            "spec": {"securityContext": copy.deepcopy(POD_CONTEXT), "containers": list(containers), **spec}}


def rayservice(name: str = "fairserve") -> dict:
    hf_token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    head_ports = [{"containerPort": 8000, "name": "serve"}, {"containerPort": 8080, "name": "metrics"}]
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": name, "namespace": "serving", "labels": {"helm.sh/chart": "fairserve-0.1.0"}},
        "spec": {
            "serveConfigV2": SERVE_CONFIG, "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterDeletionDelaySeconds": 120,
            "rayClusterConfig": {
                "rayVersion": "2.52.0", "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"version": "v2", "idleTimeoutSeconds": 60,
                                      "securityContext": copy.deepcopy(HARDENED)},
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "num-gpus": "0"},
                                  "template": pod_template(container("ray-head", ports=head_ports))},
                "workerGroupSpecs": [
                    {"groupName": "router", "replicas": 1, "minReplicas": 1, "maxReplicas": 2,
                     "rayStartParams": {}, "template": pod_template(container("ray-worker", cpu=4))},
                    {"groupName": "gpu", "replicas": 0, "minReplicas": 0, "maxReplicas": 4, "rayStartParams": {},
                     "template": pod_template(
                         container("ray-worker", cpu="8", memory="32Gi", env=[hf_token],
                                   accelerators={"nvidia.com/gpu": "1"}),
                         tolerations=[gpu_toleration])},
                ],
            },
        },
    }


def deployment(name: str = "redis-exporter") -> dict:
    labels = {"app.kubernetes.io/name": name}
    password = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "serving"},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"securityContext": copy.deepcopy(POD_CONTEXT),
                                           "automountServiceAccountToken": False,
                                           "containers": [container(name, cpu="100m", memory="64Mi",
                                                                    env=[password])]}}}}


def cluster(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]


def head(doc: dict) -> dict:
    return cluster(doc)["headGroupSpec"]


def worker(doc: dict, index: int = 0) -> dict:
    return cluster(doc)["workerGroupSpecs"][index]


def ray_of(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def changed(make: Callable[[], dict], change: Callable[[dict], Any]) -> dict:
    doc = make()
    change(doc)
    return doc


def assert_found(problems: list[str], expected: str) -> None:
    assert any(expected in p for p in problems), f"{expected!r} not in {problems}"


# --- builtin_problems ------------------------------------------------------------------------------

CUSTOM_RESOURCES = [rayservice(),
                    {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "m"}},
                    {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "r"}}]


def test_builtin_good_manifests_pass_and_custom_resources_are_skipped():
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
               "spec": {"ports": [{"port": 8000, "targetPort": "serve"}], "selector": {"a": "b"}}}
    ingress = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "i"},
               "spec": {"ingressClassName": "nginx"}}
    assert is_builtin(ingress) and not any(is_builtin(d) for d in CUSTOM_RESOURCES)
    assert builtin_problems([deployment(), service, ingress, None, *CUSTOM_RESOURCES]) == []


@pytest.mark.parametrize("doc, expected", [
    (changed(deployment, lambda d: d["spec"].update(replica=2)), "'replica' was unexpected"),
    (changed(deployment, lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=1)),
     "spec.template.spec.containers[0].imagePullPolicy: 1 is not of type 'string'"),
    ({"apiVersion": "apps/v1", "kind": "FooSet", "metadata": {"name": "f"}}, "Couldn't find schema for kind FooSet"),
    ({"apiVersion": "policy/v1beta1", "kind": "PodSecurityPolicy", "metadata": {"name": "p"}},
     "Couldn't find schema for kind PodSecurityPolicy"),
    ("just a string", "not a Kubernetes object"),
])
def test_builtin_bad_manifests_are_caught(doc, expected):
    assert_found(builtin_problems([doc]), expected)


# --- rayservice_crd_problems -----------------------------------------------------------------------


def test_crd_good_rayservice_passes_with_int_and_string_forms():
    doc = rayservice()
    ray_of(worker(doc))["resources"]["limits"]["cpu"] = 4  # a quantity as an integer
    ray_of(worker(doc))["readinessProbe"] = {"httpGet": {"path": "/", "port": "serve"}}  # int-or-string
    head(doc)["template"]["spec"]["containers"][0]["ports"][0]["protocol"] = "TCP"
    assert rayservice_crd_problems(doc) == []
    assert kuberay_rules.load_crd_schema("v1") is kuberay_rules.load_crd_schema("v1")  # cached


@pytest.mark.parametrize("change, expected", [
    (lambda d: head(d).update(rayStartParam={}), "headGroupSpec: Additional properties are not allowed ('rayStartParam'"),
    (lambda d: head(d)["rayStartParams"].update({"num-cpus": 0}), "rayStartParams.num-cpus: 0 is not of type 'string'"),
    (lambda d: ray_of(worker(d))["resources"]["limits"].update(cpu=0.5), "limits.cpu: 0.5 must be an integer or a string (quote"),
    (lambda d: ray_of(worker(d))["resources"]["limits"].update(memory="8 Gi"), "'8 Gi' is not a Kubernetes quantity"),
    (lambda d: worker(d).pop("minReplicas"), "workerGroupSpecs[0]: 'minReplicas' is a required property"),
    (lambda d: head(d)["template"]["spec"]["containers"][0]["ports"][0].update(containerPort=2**40), "is not a 'int32'"),
    (lambda d: cluster(d).update(managedBy="me"), "managedBy: 'me' is not one of"),
    (lambda d: ray_of(worker(d)).update(securityContxt={}), "'securityContxt' was unexpected"),
    (lambda d: d.update(kind="RayCluster"), "is not a ray.io RayService"),
    (lambda d: d.update(apiVersion="ray.io/v2"), "has no version 'v2'"),
])
def test_crd_bad_rayservices_are_caught(change, expected):
    assert_found(rayservice_crd_problems(changed(rayservice, change)), expected)


# --- pod_templates and pod_template_problems ---------------------------------------------------------


def test_pod_templates_wrap_head_and_every_worker_group():
    templates = pod_templates(rayservice())
    assert [t["metadata"]["name"] for t in templates] == ["fairserve-head", "fairserve-worker-router", "fairserve-worker-gpu"]
    assert {t["kind"] for t in templates} == {"PodTemplate"} and templates[2]["template"]["spec"]["tolerations"]
    assert pod_template_problems(rayservice()) == []


def test_pod_template_problems_catch_what_the_crd_schema_lets_through():
    doc = changed(rayservice, lambda d: ray_of(worker(d, 1))["resources"].update(claims="gpu"))
    assert_found(pod_template_problems(doc), "PodTemplate/fairserve-worker-gpu: template.spec.containers[0].resources.claims")


# --- kuberay_rule_problems -------------------------------------------------------------------------

GCS_FT = {"redisAddress": "redis:6379",
          "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}}}
INCREMENTAL = {"type": "NewClusterWithIncrementalUpgrade",
               "clusterUpgradeOptions": {"gatewayClassName": "istio", "stepSizePercent": 25,
                                         "maxSurgePercent": 50, "intervalSeconds": 30}}


@pytest.mark.parametrize("change", [
    lambda d: None,
    lambda d: d["metadata"].update(name="f" * 47, annotations={"ray.io/initializing-timeout": "30m"}),
    lambda d: cluster(d).update(gcsFaultToleranceOptions=copy.deepcopy(GCS_FT)),
    lambda d: d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)),
    lambda d: head(d)["rayStartParams"].update({"plasma-directory": "/plasma"}) or ray_of(head(d)).update(
        volumeMounts=[{"name": "shm", "mountPath": "/dev/shm"}]),
    lambda d: head(d)["template"]["spec"]["containers"].append(container("fluent-bit")),
], ids=["fairserve", "47-char name", "gcs-ft", "incremental", "plasma-directory", "sidecar after"])
def test_kuberay_rules_accept_good_rayservices(change):
    assert kuberay_rule_problems(changed(rayservice, change)) == []


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["metadata"].update(name="f" * 48), "has 48 characters; at most 47"),
    (lambda d: d["metadata"].update(name="1fairserve"), "is not a DNS-1035 label"),
    (lambda d: d["metadata"].update(annotations={"ray.io/initializing-timeout": "-5m"}), "initializing-timeout='-5m'"),
    (lambda d: cluster(d).update(authOptions={"mode": "token", "enableK8sTokenAuth": True}), "enableK8sTokenAuth is not supported"),
    (lambda d: head(d).update(headService={"metadata": {"name": "svc"}}), "headService.metadata.name must not be set"),
    (lambda d: d["spec"].update(upgradeStrategy={"type": "BlueGreen"}), "upgradeStrategy.type 'BlueGreen' is not one of"),
    (lambda d: d["spec"].update(rayClusterDeletionDelaySeconds=-1), "rayClusterDeletionDelaySeconds -1"),
    (lambda d: cluster(d).update(upgradeStrategy={"type": "Recreate"}), "rayClusterConfig.upgradeStrategy.type cannot be set"),
    (lambda d: (d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)), cluster(d).pop("enableInTreeAutoscaling")),
     "requires enableInTreeAutoscaling"),
    (lambda d: d["spec"].update(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade"}), "requires upgradeStrategy.clusterUpgradeOptions"),
    (lambda d: (d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)),
                d["spec"]["upgradeStrategy"]["clusterUpgradeOptions"].update(stepSizePercent=60)),
     "stepSizePercent 60 must be <= maxSurgePercent 50"),
    (lambda d: (d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)),
                d["spec"]["upgradeStrategy"]["clusterUpgradeOptions"].update(intervalSeconds=0, gatewayClassName="")),
     "intervalSeconds 0 must be > 0"),
    (lambda d: (d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)),
                d["spec"]["upgradeStrategy"]["clusterUpgradeOptions"].update(stepSizePercent=0)), "0 stalls the upgrade"),
    (lambda d: worker(d).pop("maxReplicas"), "worker group 'router': must set both minReplicas and maxReplicas"),
    (lambda d: worker(d).update(minReplicas=3), "minReplicas 3 is greater than maxReplicas 2"),
    (lambda d: worker(d).update(replicas=5), "replicas 5 is outside [1, 2]"),
    (lambda d: worker(d, 1).update(groupName="router"), "worker group name 'router' is used more than once"),
    (lambda d: worker(d).update(resources={"CPU": "4"}, rayStartParams={"num-cpus": "4"}), "set both in rayStartParams and in `resources`"),
    (lambda d: worker(d)["rayStartParams"].update(labels="a=b"), "rayStartParams['labels'] is not supported"),
    (lambda d: worker(d).update(labels={"bad key!": "v"}), "invalid label key 'bad key!'"),
    (lambda d: worker(d).update(idleTimeoutSeconds=-1), "idleTimeoutSeconds -1 must be >= 0"),
    (lambda d: (worker(d).update(idleTimeoutSeconds=30), cluster(d)["autoscalerOptions"].pop("version")),
     "idleTimeoutSeconds needs autoscalerOptions.version v2"),
    (lambda d: worker(d).update(priority=5), "priority needs rayVersion >= 2.56.0"),
    (lambda d: worker(d).update(suspend=True), "cannot be suspended with the autoscaler enabled"),
    (lambda d: ray_of(head(d)).update(env=[{"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}]),
     "RAY_REDIS_ADDRESS enables GCS FT implicitly"),
    (lambda d: head(d)["rayStartParams"].update({"redis-username": "u"}), "redis username set in rayStartParams"),
    (lambda d: (cluster(d).update(gcsFaultToleranceOptions=copy.deepcopy(GCS_FT)),
                head(d)["rayStartParams"].update({"redis-password": "$(REDIS_PASSWORD)"})),
     "rayStartParams redis-password is set with gcsFaultToleranceOptions"),
    (lambda d: (cluster(d).update(gcsFaultToleranceOptions=copy.deepcopy(GCS_FT)), ray_of(head(d)).update(
        env=[{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "r", "key": "p"}}}])),
     "head env REDIS_PASSWORD is set with gcsFaultToleranceOptions"),
    (lambda d: (cluster(d).update(gcsFaultToleranceOptions=copy.deepcopy(GCS_FT)),
                d["metadata"].update(annotations={"ray.io/ft-enabled": "true"})), "annotation and gcsFaultToleranceOptions are both set"),
    (lambda d: (cluster(d).update(gcsFaultToleranceOptions=copy.deepcopy(GCS_FT)),
                d["metadata"].update(annotations={"ray.io/external-storage-namespace": "x"})), "external-storage-namespace is set"),
    (lambda d: cluster(d).update(gcsFaultToleranceOptions={**GCS_FT, "storage": {}}), "storage only applies to the rocksdb"),
    (lambda d: (cluster(d).pop("enableInTreeAutoscaling"),
                ray_of(head(d)).update(env=[{"name": "RAY_enable_autoscaler_v2", "value": "1"}])), "without enableInTreeAutoscaling"),
    (lambda d: ray_of(head(d)).update(env=[{"name": "RAY_enable_autoscaler_v2", "value": "1"}]),
     "both autoscalerOptions.version and head env"),
    (lambda d: worker(d, 1)["template"]["spec"].update(restartPolicy="Always"), "'gpu': restartPolicy 'Always' must be Never"),
    (lambda d: cluster(d)["autoscalerOptions"].update(env=[{"name": "KUBERAY_GEN_AUTOSCALER_START_CMD", "value": "x"}]),
     "must not set KUBERAY_GEN_AUTOSCALER_START_CMD"),
    (lambda d: cluster(d).update(networkPolicy={}), "networkPolicy needs a KubeRay feature gate"),
    (lambda d: cluster(d).update(rayVersion="2.51.0", authOptions={"mode": "token"}), "mode token needs rayVersion >= 2.52.0"),
    (lambda d: head(d)["template"]["spec"]["containers"].insert(0, container("fluent-bit")),
     "head: containers[0] is 'fluent-bit'; KubeRay takes index 0"),
    (lambda d: ray_of(worker(d)).pop("image"), "the Ray container has no image"),
    (lambda d: ray_of(worker(d)).update(readinessProbe={"exec": {"command": ["true"]}}), "sets readinessProbe; KubeRay injects"),
    (lambda d: ray_of(worker(d)).update(volumeMounts=[{"name": "shm", "mountPath": "/dev/shm"}]), "mounts /dev/shm"),
    (lambda d: worker(d)["template"]["spec"].update(volumes=[{"name": "shared-mem", "emptyDir": {}}]), "volume 'shared-mem'"),
    (lambda d: worker(d)["rayStartParams"].update({"num-gpus": 1}), "rayStartParams['num-gpus'] = 1 is not a string"),
])
def test_kuberay_rules_catch_bad_rayservices(change, expected):
    assert_found(kuberay_rule_problems(changed(rayservice, change)), expected)


# --- kuberay_cluster_hash, cluster_update_action, rebuilds_cluster ----------------------------------


def limits(doc: dict) -> dict:
    return ray_of(head(doc))["resources"]["limits"]


@pytest.mark.parametrize("change, action", [
    (lambda d: d["metadata"]["labels"].update({"helm.sh/chart": "fairserve-0.2.0"}), ClusterAction.NONE),
    (lambda d: d["spec"].update(serveConfigV2=SERVE_CONFIG.replace("64", "128")), ClusterAction.NONE),
    (lambda d: worker(d, 1).update(replicas=2, minReplicas=1, maxReplicas=8), ClusterAction.NONE),
    (lambda d: worker(d, 1).update(scaleStrategy={"workersToDelete": ["gpu-abcde"]}), ClusterAction.NONE),
    (lambda d: worker(d, 1)["template"]["spec"].pop("tolerations"), ClusterAction.NONE),
    (lambda d: cluster(d).update(suspend=True), ClusterAction.NONE),
    (lambda d: limits(d).update(cpu="2000m", memory="8192Mi"), ClusterAction.NONE),  # same canonical quantities
    (lambda d: limits(d).update(cpu=2), ClusterAction.NONE),
    (lambda d: ray_of(head(d))["ports"][0].update(protocol="TCP"), ClusterAction.NONE),  # the CRD default
    (lambda d: cluster(d)["workerGroupSpecs"].append({**copy.deepcopy(worker(d, 1)), "groupName": "gpu2"}),
     ClusterAction.UPDATE_IN_PLACE),
    (lambda d: ray_of(head(d)).update(image="ghcr.io/fairserve/fairserve:0.2.0"), ClusterAction.NEW_CLUSTER),
    (lambda d: head(d)["template"]["metadata"]["labels"].update({"helm.sh/chart": "fairserve-0.2.0"}), ClusterAction.NEW_CLUSTER),
    (lambda d: head(d)["template"].setdefault("metadata", {}).update(annotations={"checksum/config": "1"}),
     ClusterAction.NEW_CLUSTER),
    (lambda d: ray_of(worker(d)).update(env=[{"name": "FAIRSERVE_X", "value": "1"}]), ClusterAction.NEW_CLUSTER),
    (lambda d: limits(d).update(memory="9Gi"), ClusterAction.NEW_CLUSTER),
    (lambda d: ray_of(head(d))["ports"][0].update(protocol="UDP"), ClusterAction.NEW_CLUSTER),
    (lambda d: cluster(d)["workerGroupSpecs"].pop(), ClusterAction.NEW_CLUSTER),
    (lambda d: cluster(d)["workerGroupSpecs"].insert(0, {**copy.deepcopy(worker(d)), "groupName": "first"}),
     ClusterAction.NEW_CLUSTER),
    (lambda d: (cluster(d)["workerGroupSpecs"].append({**copy.deepcopy(worker(d)), "groupName": "more"}),
                ray_of(worker(d)).update(image="x:2")), ClusterAction.NEW_CLUSTER),
    (lambda d: (d["spec"].update(upgradeStrategy={"type": "None"}), ray_of(head(d)).update(image="x:2")),
     ClusterAction.NOT_APPLIED),
    (lambda d: (d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)), ray_of(head(d)).update(image="x:2")),
     ClusterAction.NEW_CLUSTER),
])
def test_cluster_update_action_follows_the_controller(change, action):
    old, new = rayservice(), changed(rayservice, change)
    assert cluster_update_action(old, new) is action
    assert rebuilds_cluster(old, new) is (action is ClusterAction.NEW_CLUSTER)
    assert (kuberay_cluster_hash(old) == kuberay_cluster_hash(new)) is (action is ClusterAction.NONE)


def test_older_kuberay_versions_hash_what_they_did_not_mute():
    old = rayservice()
    no_tolerations = changed(rayservice, lambda d: worker(d, 1)["template"]["spec"].pop("tolerations"))
    assert cluster_update_action(old, no_tolerations, kuberay_version="1.6") is ClusterAction.NONE
    assert cluster_update_action(old, no_tolerations, kuberay_version="1.5") is ClusterAction.NEW_CLUSTER
    suspended = changed(rayservice, lambda d: cluster(d).update(suspend=True))
    assert rebuilds_cluster(old, suspended, kuberay_version="1.6")
    incremental = changed(rayservice, lambda d: (d["spec"].update(upgradeStrategy=copy.deepcopy(INCREMENTAL)),
                                                 ray_of(head(d)).update(image="x:2")))
    assert cluster_update_action(old, incremental, kuberay_version="1.6") is ClusterAction.NOT_APPLIED
    unset = changed(rayservice, lambda d: (d["spec"].pop("upgradeStrategy"), ray_of(head(d)).update(image="x:2")))
    assert rebuilds_cluster(old, unset) and not rebuilds_cluster(old, unset, operator_zero_downtime=False)
    with pytest.raises(ValueError, match="older than the 1.5"):
        kuberay_cluster_hash(old, kuberay_version="1.4")


@pytest.mark.parametrize("text, canonical", [
    ("1000m", "1"), ("1", "1"), (2, "2"), ("1.0", "1"), ("1.5", "1500m"), (".5", "500m"), ("100m", "100m"),
    ("0.1m", "100u"), ("1000", "1k"), ("1536", "1536"), ("1e3", "1e3"), ("1E3", "1e3"), ("12e6", "12e6"),
    ("0", "0"), ("0Gi", "0"), ("1Ki", "1Ki"), ("1024Mi", "1Gi"), ("2048Ki", "2Mi"), ("0.5Gi", "512Mi"),
    ("1.5Gi", "1536Mi"), ("512", "512"), ("-1000m", "-1"), ("8 Gi", None), ("1K", None), (True, None),
])
def test_canonical_quantity_matches_go(text, canonical):
    assert canonical_quantity(text) == canonical


# --- security_problems -----------------------------------------------------------------------------


def statefulset() -> dict:
    spec = {**copy.deepcopy(deployment("redis")["spec"]), "serviceName": "redis-headless"}
    spec["template"]["spec"]["containers"][0]["args"] = ["--requirepass", "$(REDIS_PASSWORD)", "--appendonly", "yes"]
    spec["template"]["spec"]["initContainers"] = [container("init-perms", cpu="50m", memory="32Mi")]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "redis"}, "spec": spec}


def cronjob() -> dict:
    template = copy.deepcopy(deployment("cleanup")["spec"]["template"])
    template["spec"]["restartPolicy"] = "Never"
    return {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "cleanup"},
            "spec": {"schedule": "0 * * * *", "jobTemplate": {"spec": {"template": template}}}}


def configmap() -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "redis"},
            "data": {"redis.conf": "appendonly yes\nappendfsync always\nprotected-mode yes\n"}}


def good_docs() -> list[dict]:
    return [rayservice(), deployment(), statefulset(), cronjob(), configmap()]


def test_security_good_manifests_pass():
    assert security_problems(good_docs()) == []
    assert builtin_problems(good_docs()) == []  # the good manifests are valid objects too


def first_container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("change, expected", [
    (lambda ds: first_container(ds[1])["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation is not false"),
    (lambda ds: (ds[1]["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
                 first_container(ds[1])["securityContext"].pop("runAsNonRoot")), "runAsNonRoot is not true"),
    (lambda ds: first_container(ds[1])["securityContext"].update(runAsNonRoot=False), "runAsNonRoot is not true"),
    (lambda ds: first_container(ds[1])["securityContext"].update(runAsUser=0), "runs as uid 0"),
    (lambda ds: first_container(ds[1])["securityContext"].update(capabilities={"drop": ["NET_RAW"]}), "does not contain ALL"),
    (lambda ds: first_container(ds[1])["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "adds capabilities"),
    (lambda ds: first_container(ds[1])["securityContext"].update(privileged=True), "is privileged"),
    (lambda ds: (ds[1]["spec"]["template"]["spec"]["securityContext"].pop("seccompProfile"),
                 first_container(ds[1])["securityContext"].pop("seccompProfile")), "seccompProfile.type is None"),
    (lambda ds: first_container(ds[1])["securityContext"].update(seccompProfile={"type": "Unconfined"}), "'Unconfined'"),
    (lambda ds: first_container(ds[1])["resources"]["limits"].pop("memory"), "has no limits for memory"),
    (lambda ds: first_container(ds[1])["resources"].pop("requests"), "has no requests for cpu"),
    (lambda ds: first_container(ds[1]).update(image="redis:latest"), "uses the latest tag"),
    (lambda ds: first_container(ds[1]).update(image="registry:5000/redis"), "neither a tag nor a digest"),
    (lambda ds: first_container(ds[1]).update(env=[{"name": "API_KEY", "value": "abc"}]), "env API_KEY has a literal value"),
    (lambda ds: first_container(ds[1]).update(env=[{"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]),
     "env HF_TOKEN comes from a ConfigMap"),
    (lambda ds: first_container(ds[2]).update(args=["--requirepass", "hunter2"]), "'requirepass hunter2'"),
    (lambda ds: first_container(ds[2]).update(command=["sh", "-c", "redis-cli -u redis://:hunter2@redis ping"]),
     "redis://:hunter2@"),
    (lambda ds: ds[2]["spec"]["template"]["spec"]["initContainers"][0].pop("securityContext"),
     "'init-perms': allowPrivilegeEscalation is not false"),
    (lambda ds: ds[3]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0].update(image="x"),
     "CronJob/cleanup container 'cleanup': image 'x' has neither"),
    (lambda ds: ds[4]["data"].update({"redis.conf": "requirepass s3cret\n"}), "ConfigMap/redis redis.conf: secret-looking literal"),
    (lambda ds: ds[4]["data"].update(REDIS_PASSWORD="s3cret"), "data key 'REDIS_PASSWORD' holds a literal secret"),
    (lambda ds: ray_of(worker(ds[0], 1))["securityContext"].pop("capabilities"), "worker group 'gpu' container 'ray-worker'"),
    (lambda ds: cluster(ds[0])["autoscalerOptions"].pop("securityContext"), "container 'autoscaler (autoscalerOptions)'"),
    (lambda ds: cluster(ds[0])["autoscalerOptions"].update(resources={"limits": {"cpu": "1"}}), "autoscaler (autoscalerOptions)': has no"),
    (lambda ds: cluster(ds[0]).update(gcsFaultToleranceOptions={"redisPassword": {"value": "hunter2"}}), "redisPassword.value is a literal"),
    (lambda ds: head(ds[0])["rayStartParams"].update({"redis-password": "hunter2"}), "rayStartParams['redis-password']"),
    (lambda ds: ds[0]["spec"].update(serveConfigV2=SERVE_CONFIG.replace("${HF_TOKEN}", "hf_abc")), ".runtime_env.env_vars.HF_TOKEN"),
    (lambda ds: ds[0]["spec"].update(serveConfigV2=SERVE_CONFIG.replace("max_tokens: 512", "api_key: sk-123")), "args.api_key holds"),
    (lambda ds: ds[0]["spec"].update(serveConfigV2=SERVE_CONFIG.replace("${REDIS_PASSWORD}", "pw")), "redis://:pw@"),
    (lambda ds: ds[0]["spec"].update(serveConfigV2="applications: [unclosed"), "serveConfigV2 is not valid YAML"),
])
def test_security_bad_manifests_are_caught(change, expected):
    docs = good_docs()
    change(docs)
    assert_found(security_problems(docs), expected)


@pytest.mark.parametrize("text, flagged", [
    ("redis-server --requirepass $(REDIS_PASSWORD)", False), ("redis-server --requirepass hunter2", True),
    ("masterauth 'hunter2'", True), ("--api-key=$(API_KEY)", False), ("--api-key=sk-123", True),
    ("--redis-password ${REDIS_PASSWORD}", False), ("--token-file /var/run/token", False),
    ("--tls-key /etc/tls/key.pem", False), ("export REDIS_PASSWORD=hunter2 && run", True),
    ("TOKENIZERS_PARALLELISM=false python -m x", False), ("redis://user:$(PASS)@h:6379", False),
    ("rediss://default:hunter2@h:6379/0", True), ("python -m router --max-tokens 512", False),
    ("export HF_TOKEN=$(cat /run/secrets/hf/token)", False), ("--secret=hunter2", True),
])
def test_secret_text_heuristics(text, flagged):
    assert bool(secret_text_problems(text)) is flagged, secret_text_problems(text)


# --- checkov_problems --------------------------------------------------------------------------------


def checkov_bin() -> str:
    """$CHECKOV_BIN (then it must work), else a checkov venv beside or in /tmp, else PATH."""
    if os.environ.get("CHECKOV_BIN"):
        return os.environ["CHECKOV_BIN"]
    for candidate in (Path(__file__).resolve().parents[2] / ".venv-checkov/bin/checkov",
                      Path("/tmp/checkov-venv/bin/checkov")):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("checkov")
    if not found:
        pytest.skip("checkov not installed: python3 -m venv .venv-checkov && .venv-checkov/bin/pip install checkov==3.3.30")
    return found


def test_checkov_reports_failed_checks_and_the_checks_that_ran(tmp_path):
    bare = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "bare", "namespace": "serving"},
            "template": {"spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]}}}
    (tmp_path / "ray.yaml").write_text(yaml.safe_dump_all(pod_templates(rayservice())))
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(bare))
    config = tmp_path / "checkov-config.yaml"  # the checks a chart would skip with a reason
    config.write_text(yaml.safe_dump({"skip-check": ["CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_22", "CKV_K8S_35"]}))
    report = checkov_problems(tmp_path, checkov_bin(), config_file=config)
    assert report.resource_count == 4
    assert {"CKV_K8S_20", "CKV_K8S_28", "CKV_K8S_37"} <= set(report.checks_run)
    assert_found(report.problems, "CKV_K8S_20 (Containers should not run with allowPrivilegeEscalation): PodTemplate.serving.bare")
    assert [p for p in report.problems if "fairserve" in p] == []  # the Ray templates pass
    assert_found(report.skipped, "CKV_K8S_8 PodTemplate.serving.fairserve-head: KubeRay injects")
    assert "CKV_K8S_43" not in report.checks_run  # the config file was read
