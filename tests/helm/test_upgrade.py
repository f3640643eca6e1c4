"""Which changes rebuild the Ray cluster: KubeRay hashes rayClusterConfig (without replica
counts, workersToDelete, tolerations, scheduling gates and suspend) and builds a whole new
cluster when the hash changes, appended worker groups excepted (tests/helm/kuberay_rules.py
re-implements that decision). A chart bump and every change under `fairserve:` must not
rebuild; an image change must."""

from __future__ import annotations

import shutil
from pathlib import Path

import helm_python
import pytest
import yaml

from tests.helm.chart import CHART_DIR, NAMESPACE, merge, rayservice, render, values_of
from tests.helm.validators import ClusterAction, cluster_update_action

BEFORE = values_of("gpu")


def action(after: dict) -> ClusterAction:
    return cluster_update_action(rayservice(render(BEFORE)), rayservice(render(after)))


@pytest.mark.parametrize("change", [
    {"fairserve": {"engine": {"max_num_seqs": 96}}},
    {"fairserve": {"replicas": {"autoscaling": {"max_replicas": 12, "target_drain_s": 10}}}},
    {"fairserve": {"router": {"num_replicas": 4, "api": {"max_n": 4}}}},
    {"fairserve": {"queues": {"lease_ms": 60000}}},
    {"upgrade": {"clusterDeletionDelaySeconds": 3600}},
    {"ingress": {"enabled": True, "hosts": ["llm.example.com"]}},
    {"metrics": {"podMonitor": {"enabled": True}}},
], ids=["engine", "autoscaling", "router", "queues", "deletion-delay", "ingress", "podmonitor"])
def test_serve_and_release_changes_leave_the_cluster_alone(change: dict) -> None:
    assert action(merge(BEFORE, change)) is ClusterAction.NONE


@pytest.mark.parametrize("change", [
    {"ray": {"routerGroup": {"maxReplicas": 10, "minReplicas": 2}}},
    {"ray": {"modelGroups": [merge(BEFORE["ray"]["modelGroups"][0], {"maxReplicas": 16})]}},
    {"ray": {"modelGroups": [merge(BEFORE["ray"]["modelGroups"][0], {"tolerations": [
        {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]})]}},
], ids=["router-replicas", "model-replicas", "tolerations"])
def test_replica_counts_and_tolerations_do_not_rebuild(change: dict) -> None:
    assert action(merge(BEFORE, change)) in (ClusterAction.NONE, ClusterAction.UPDATE_IN_PLACE)


def test_an_appended_model_group_is_added_in_place() -> None:
    groups = [*BEFORE["ray"]["modelGroups"], {
        "name": "h100", "maxReplicas": 2, "gpus": 1, "resources": {"cpu": "16", "memory": "64Gi"}}]
    assert action(merge(BEFORE, {"ray": {"modelGroups": groups}})) is ClusterAction.UPDATE_IN_PLACE


@pytest.mark.parametrize("change", [
    {"gpuImage": {"tag": "0.1.1-cuda"}},
    {"ray": {"modelGroups": [merge(BEFORE["ray"]["modelGroups"][0], {"resources": {
        "cpu": "12", "memory": "48Gi"}})]}},
    {"telemetry": {"otlpEndpoint": "http://collector:4318"}},
], ids=["image", "resources", "pod-env"])
def test_changes_to_the_ray_pods_rebuild(change: dict) -> None:
    assert action(merge(BEFORE, change)) is ClusterAction.NEW_CLUSTER


def test_a_chart_version_bump_does_not_rebuild(tmp_path: Path) -> None:
    bumped = tmp_path / "fairserve"
    shutil.copytree(CHART_DIR, bumped)  # the dashboard link is copied as its file
    chart_yaml = yaml.safe_load((bumped / "Chart.yaml").read_text())
    chart_yaml["version"] = "0.2.0"  # the chart changed; the app (and its images) did not
    (bumped / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml))
    chart = helm_python.Chart.load(str(bumped))
    rendered = chart.render(BEFORE, name="demo", namespace=NAMESPACE)
    after = [d for path, text in rendered.items() if not path.endswith("NOTES.txt")
             for d in yaml.safe_load_all(text) if d and d.get("kind") == "RayService"]
    before = rayservice(render(BEFORE))
    assert after[0]["metadata"]["labels"]["helm.sh/chart"] == "fairserve-0.2.0"
    assert cluster_update_action(before, after[0]) is ClusterAction.NONE


def test_ray_pod_templates_carry_only_stable_labels() -> None:
    spec = rayservice(render(values_of("hardened")))["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        metadata = group["template"]["metadata"]
        assert set(metadata["labels"]) == {"app.kubernetes.io/name", "app.kubernetes.io/instance",
                                           "app.kubernetes.io/component"}
        assert "annotations" not in metadata
