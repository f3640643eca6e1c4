"""The chart with the real Helm engine, offline: lint, the render matrix (every ci/ profile,
release names of 1 and 53 characters and one starting with a digit), determinism, the values
schema (its source, Helm enforcing it), and what each template does with its values."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import helm_python
import pytest
import yaml
from jsonschema import Draft202012Validator

from cluster.ray_quiet import QUIET_ENV
from tests.helm.chart import (
    CHART_DIR,
    PROFILES,
    REPO,
    notes,
    of_kind,
    profile,
    rayservice,
    render,
    render_files,
    serve_config,
    values_of,
)

RELEASES = ["a", "r" * 53, "1st"]


def group(name: str, **fields: object) -> dict[str, object]:
    return {"name": name, "maxReplicas": 2, "resources": {"cpu": "4", "memory": "16Gi"},
            **fields}
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


# ---- lint, names, determinism ----


@pytest.mark.parametrize("name", [None, *PROFILES])
def test_helm_lint_strict_finds_nothing_above_info(name: str | None) -> None:
    report = helm_python.lint(str(CHART_DIR), values_of(name), strict=True, namespace="llm",
                              kube_version="v1.32.0")
    assert not report["errors"], report
    assert all(m["severity"] <= 1 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_and_release_name_renders_names_kubernetes_takes(name: str,
                                                                       release: str) -> None:
    docs = render(values_of(name), release, with_tests=True)
    service = rayservice(docs)["metadata"]["name"]
    # KubeRay: at most 47 characters (it appends suffixes), a DNS-1035 label
    assert len(service) <= 47 and DNS_1035.match(service), service
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    assert render(values_of(name), release, with_tests=True) == docs  # no randomness, no time


def test_renders_are_byte_identical() -> None:
    values = values_of("hardened")
    assert render_files(values) == render_files(values)


# ---- the values schema ----


def test_schema_is_draft_2020_12_self_contained_and_closed() -> None:
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    text = json.dumps(SCHEMA)
    assert '"$ref": "http' not in text and "://" not in "".join(re.findall(r'"\$ref": "[^"]*"',
                                                                          text))
    # every object the chart owns is closed; Kubernetes objects passed through stay open
    for name, definition in SCHEMA["$defs"].items():
        if "properties" in definition:
            assert definition.get("additionalProperties") is False, name
    assert SCHEMA["additionalProperties"] is False


def test_values_yaml_and_schema_are_generated_from_the_models() -> None:
    check = subprocess.run([sys.executable, str(REPO / "helm" / "chart_values.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    sys.path.insert(0, str(REPO / "helm"))
    import chart_values

    assert chart_values.undocumented() == []  # every value has its description


@pytest.mark.parametrize("name", PROFILES)
def test_values_and_every_profile_validate_against_the_schema(name: str) -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    validator = Draft202012Validator(SCHEMA)
    assert not list(validator.iter_errors(defaults))
    from tests.helm.chart import merge

    errors = [e.message for e in validator.iter_errors(merge(defaults, profile(name)))]
    assert not errors, errors


@pytest.mark.parametrize(("bad", "named"), [
    ({"fairserve": {"engine": {"max_num_seq": 32}}}, "'max_num_seq' not allowed"),
    ({"ray": {"head": {"rayStartParams": {"num-cpus": 0}}}}, "/ray/head/rayStartParams/num-cpus"),
    ({"upgrade": {"strategy": "BlueGreen"}}, "/upgrade/strategy"),
    ({"redis": {"mode": "cluster"}}, "/redis/mode"),
    ({"fairserve": {"engine": {"model": "/models/x.gguf"}}}, "'model' not allowed"),
    ({"image": {"tag": "latest"}}, "/image/tag"),
    ({"fairserve": {"replicas": {"num_cpus": -1}}}, "/fairserve/replicas/num_cpus"),
    ({"ray": {"modelGroups": [{"name": "gpu", "maxReplicas": 2}]}}, "'resources'"),
    ({"fairserve": {"replicas": {"max_ongoing_requests": 0}}}, "max_ongoing_requests"),
    ({"ray": {"modelGroups": [{"name": "GPU_1"}]}}, "/ray/modelGroups/0/name"),
])
def test_helm_refuses_a_bad_value_naming_it(bad: dict, named: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(named)):
        render(values_of(None, **bad))


# ---- validate.yaml: fail fast, naming the value ----


@pytest.mark.parametrize(("overrides", "named"), [
    ({"preflight": {"requireKubeRayCRDs": True}}, "preflight.requireKubeRayCRDs"),
    ({"redis": {"embedded": {"auth": {"existingSecret": ""}}}},
     "redis.embedded.auth.existingSecret"),
    ({"redis": {"mode": "external"}}, "redis.external.url"),
    ({"redis": {"mode": "external", "external": {"url": "redis://u:hunter2@h:6379/0"}}},
     "the URL carries a password"),
    ({"redis": {"mode": "external", "external": {
        "url": "redis+sentinel://u:hunter2@s1:26379,s2:26379/fs"}}}, "the URL carries a password"),
    ({"model": {"source": "pvc"}}, "model.path"),
    ({"model": {"path": "models/x.gguf"}}, "must be an absolute path"),
    ({"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade"}},
     "upgrade.incremental.gatewayClassName"),
    ({"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade", "incremental": {
        "gatewayClassName": "gw", "stepSizePercent": 50, "maxSurgePercent": 20}}},
     "stepSizePercent"),
    ({"ray": {"routerGroup": {"minReplicas": 4, "maxReplicas": 2}}}, "ray.routerGroup"),
    ({"ray": {"modelGroups": [group("a", minReplicas=3, maxReplicas=1)]}}, "ray.modelGroups[a]"),
    ({"ray": {"modelGroups": [group("a"), group("a")]}}, "used twice"),
    ({"ray": {"modelGroups": [group("gpu", gpus=1)]}}, "fairserve.replicas.num_gpus is 0"),
    ({"fairserve": {"replicas": {"num_gpus": 2}}, "ray": {"modelGroups": [
        group("gpu", gpus=1)]}}, "fits no pod of ray.modelGroups"),
    ({"fairserve": {"replicas": {"num_cpus": 8}}}, "fits no pod of ray.modelGroups"),
    ({"fairserve": {"router": {"num_cpus": 3}}}, "does not fit a router pod"),
    ({"fairserve": {"replicas": {"max_ongoing_requests": 100}}},
     "exceeds fairserve.engine.max_num_seqs"),
    ({"fairserve": {"router": {"graceful_shutdown_timeout_s": 30}}},
     "fairserve.router.graceful_shutdown_timeout_s (30) is not above"),
    ({"ray": {"terminationGracePeriodSeconds": 60}}, "ray.terminationGracePeriodSeconds (60)"),
    ({"gcsFaultTolerance": {"enabled": True}, "redis": {"mode": "external", "external": {
        "url": "redis://h:6379/0"}}}, "gcsFaultTolerance.redisAddress"),
])
def test_validate_fails_fast_naming_the_value(overrides: dict, named: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(named)):
        render(values_of(None, **overrides))


# ---- what the templates do ----


def test_defaults_render_the_rayservice_redis_admin_service_and_network_policies_only() -> None:
    docs = render(values_of(None))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "NetworkPolicy", "NetworkPolicy", "RayService", "Service",
                     "Service", "Service", "StatefulSet"]  # Redis's two and the admin API's


def test_external_redis_renders_no_redis_and_passes_its_secret() -> None:
    docs = render(values_of("external-redis"))
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    settings = serve_config(docs)["applications"][0]["args"]["settings"]
    assert settings["redis"] == {"url": "rediss://fairserve-queues.redis.example.internal:6380/0"}
    head = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e for e in head["containers"][0]["env"]}
    # the password as a mounted Secret, read by every Ray process (router/state/redis_client.py)
    assert env["FAIRSERVE_REDIS__PASSWORD_FILE"]["value"] == "/etc/fairserve/redis/password"
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["redis-password"]["secret"]["secretName"] == "managed-redis"
    assert volumes["redis-password"]["secret"]["items"] == [{"key": "password",
                                                             "path": "password"}]


def test_an_external_redis_behind_sentinel_renders_with_its_url_and_wait() -> None:
    url = "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379/fairserve"
    docs = render(values_of("external-redis", redis={"external": {"url": url}},
                            fairserve={"queues": {"replicas_to_ack": 1}}))
    settings = serve_config(docs)["applications"][0]["args"]["settings"]
    assert settings["redis"] == {"url": url}
    assert settings["queues"]["replicas_to_ack"] == 1


def ray_envs(docs: list[dict]) -> list[dict[str, str]]:
    """The environment of every Ray pod's container (the head's, then each group's)."""
    spec = rayservice(docs)["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    return [{e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
            for pod in pods]


def test_the_haproxy_ingress_sets_ray_serves_variables_on_every_ray_pod() -> None:
    """``fairserve.router.ingress: haproxy`` is what the launcher sets in a local Ray's
    environment (cluster/ingress.py); on Kubernetes every Ray container carries it."""
    for env in ray_envs(render(values_of(None))):  # the default
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for env in ray_envs(render(values_of(None, fairserve={"router": {"ingress": "proxy"}}))):
        assert "RAY_SERVE_ENABLE_HA_PROXY" not in env


def test_ray_quiet_sets_the_launchers_variables_on_every_ray_pod_and_false_leaves_rays() -> None:
    """``ray.quiet`` (the default) puts on every Ray container what the launcher puts in a local
    Ray's environment (cluster/ray_quiet.py), the same names and values, but for Ray's metrics,
    which stay on for the PodMonitor (with or without it: the pods do not change, see
    test_upgrade.py); false: none of them."""
    kept = {name: value for name, value in QUIET_ENV.items()
            if name != "RAY_enable_metrics_collection"}
    for values in (values_of(None), values_of(None, metrics={"podMonitor": {"enabled": True}})):
        envs = ray_envs(render(values))
        assert len(envs) >= 3  # the head, the routers, a model group
        for env in envs:
            assert {name: env.get(name) for name in QUIET_ENV} == {
                **kept, "RAY_enable_metrics_collection": None}
    for env in ray_envs(render(values_of(None, ray={"quiet": False}))):
        assert not set(QUIET_ENV) & set(env), env


def test_embedded_redis_is_durable_and_never_evicts() -> None:
    docs = render(values_of(None))
    (config,) = [d for d in of_kind(docs, "ConfigMap") if "redis" in d["metadata"]["name"]]
    conf = config["data"]["redis.conf"]
    for line in ("appendonly yes", "appendfsync always", "maxmemory-policy noeviction",
                 "maxmemory 1638mb", "protected-mode yes", "include /run/redis/auth.conf"):
        assert line in conf, line
    (redis,) = of_kind(docs, "StatefulSet")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {
        "storage": "8Gi"}
    off = render(values_of(None, redis={"embedded": {"persistence": {"enabled": False}}}))
    assert "volumeClaimTemplates" not in of_kind(off, "StatefulSet")[0]["spec"]
    assert "an emptyDir: a restart of its pod loses every queue" in notes(
        values_of(None, redis={"embedded": {"persistence": {"enabled": False}}}))


def test_gpu_groups_get_equal_gpu_requests_the_toleration_and_the_cuda_image() -> None:
    spec = rayservice(render(values_of("gpu")))["spec"]["rayClusterConfig"]
    routers, l4 = spec["workerGroupSpecs"]
    pod = l4["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"] == "fairserve/fairserve:0.1.0-cuda"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    assert (l4["minReplicas"], l4["maxReplicas"]) == (0, 8)
    assert "nvidia.com/gpu" not in routers["template"]["spec"]["containers"][0]["resources"][
        "limits"]
    settings = serve_config(render(values_of("gpu")))["applications"][0]["args"]["settings"]
    assert settings["engine"]["device"] == "cuda" and settings["engine"]["model"] == (
        "/models/Qwen2.5-7B-Instruct")
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"


def test_ingress_and_httproute_reach_the_serve_service_only() -> None:
    docs = render(values_of("hardened", httpRoute={"enabled": True, "parentRefs": [
        {"name": "gw"}]}))
    (ingress,) = of_kind(docs, "Ingress")
    (route,) = of_kind(docs, "HTTPRoute")
    service = f"{rayservice(docs)['metadata']['name']}-serve-svc"
    backends = [p["backend"]["service"] for r in ingress["spec"]["rules"]
                for p in r["http"]["paths"]]
    assert backends == [{"name": service, "port": {"number": 8000}}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": service, "port": 8000}]


def test_network_policies_keep_redis_and_the_dashboard_closed() -> None:
    docs = render(values_of("hardened"))
    redis_np, ray_np = of_kind(docs, "NetworkPolicy")
    (rule,) = redis_np["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"
    dashboard = next(r for r in ray_np["spec"]["ingress"]
                     if {"protocol": "TCP", "port": 8265} in r.get("ports", []))
    assert dashboard["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kuberay-system"}
    api = next(r for r in ray_np["spec"]["ingress"] if r.get("ports") == [
        {"protocol": "TCP", "port": 8000}])
    assert api["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ingress-nginx"}
    # Ray's other ports (the dashboard's too, through them): only this release's Ray pods,
    # never its Redis or helm-test pods
    (ray_peers,) = [r for r in ray_np["spec"]["ingress"] if "ports" not in r]
    (peer,) = ray_peers["from"]
    assert {"key": "app.kubernetes.io/component", "operator": "NotIn",
            "values": ["redis", "helm-test"]} in peer["podSelector"]["matchExpressions"]
    # with the API limited to some peers, helm test still reaches it
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get(
        "app.kubernetes.io/component") == "helm-test" for p in api["from"])
    assert not of_kind(render(values_of(None, networkPolicy={"enabled": False})),
                       "NetworkPolicy")


def test_fairserve_metrics_are_on_their_own_port_for_the_pod_monitor_only() -> None:
    """/metrics names every tenant: the routers serve it on router.api.metrics_port, never the
    API's 8000; the pods name that port, the PodMonitor scrapes it, the NetworkPolicy lets only
    networkPolicy.metricsFrom reach it, and the Service for clients does not carry it."""
    monitoring = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    docs = render(values_of(None, metrics={"podMonitor": {"enabled": True}},
                            networkPolicy={"metricsFrom": monitoring}))
    settings = serve_config(docs)["applications"][0]["args"]["settings"]
    assert settings["router"]["api"]["metrics_host"] == "0.0.0.0"
    port = settings["router"]["api"]["metrics_port"]
    assert port == 9464
    spec = rayservice(docs)["spec"]["rayClusterConfig"]
    for pod in [spec["headGroupSpec"]] + spec["workerGroupSpecs"]:
        ports = pod["template"]["spec"]["containers"][0]["ports"]
        assert {"name": "fs-metrics", "containerPort": port} in ports
    endpoints = of_kind(docs, "PodMonitor")[0]["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["metrics", "fs-metrics"]
    _, ray_np = of_kind(docs, "NetworkPolicy")
    rule = next(r for r in ray_np["spec"]["ingress"]
                if {"protocol": "TCP", "port": port} in r.get("ports", []))
    assert rule["from"] == monitoring
    assert {"protocol": "TCP", "port": 8000} not in rule["ports"]
    for service in of_kind(docs, "Service"):
        assert port not in [p.get("port") for p in service["spec"].get("ports", [])]


def test_alert_rules_watch_redis_memory_with_metrics_fairserve_emits() -> None:
    from router.telemetry.metrics import ClusterState, MetricsStore, exposition

    docs = render(values_of("hardened"))
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"FairserveRedisMemoryHigh", "FairserveStoreFull"}
    assert "> 0.85" in alerts["FairserveRedisMemoryHigh"]["expr"]
    emitted = exposition(MetricsStore(), ClusterState([], [], redis_memory=(1, 2))).decode()
    for name in ("fairserve_redis_used_memory_bytes", "fairserve_redis_maxmemory_bytes",
                 "fairserve_requests_total"):
        assert name in emitted or name.removesuffix("_total") in emitted, name
        assert any(name in a["expr"] for a in alerts.values()), name
    assert not of_kind(render(values_of(None)), "PrometheusRule")


def test_monitoring_tenants_model_pvc_and_helm_test() -> None:
    docs = render(values_of("hardened"), with_tests=True)
    assert of_kind(docs, "PodMonitor")[0]["metadata"]["labels"]["release"] == "prometheus"
    dashboards = [d for d in of_kind(docs, "ConfigMap") if "dashboards" in d["metadata"]["name"]]
    assert json.loads(dashboards[0]["data"]["fairserve-dashboard.json"])["panels"]
    head = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["tenants"]["secret"]["secretName"] == "fairserve-tenants"
    settings = serve_config(docs)["applications"][0]["args"]["settings"]
    assert settings["tenants"]["file"] == "/etc/fairserve/tenants/tenants.yaml"
    (test_pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    created = render(values_of(None, model={"source": "pvc", "path": "/models/m.gguf"}))
    (claim,) = of_kind(created, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    existing = render(values_of("gpu"))
    assert not of_kind(existing, "PersistentVolumeClaim")


def test_notes_say_how_to_reach_the_api_and_warn() -> None:
    text = notes(values_of(None))
    assert "port-forward svc/demo-fairserve-serve-svc 8000:8000" in text
    assert "GCS fault tolerance is off" in text and "twice the" in text
    assert "No model group has GPUs" in text
    quiet = notes(values_of("gcs-ft"))
    assert "GCS fault tolerance is off" not in quiet


def test_the_admin_api_has_its_own_cluster_internal_service_and_token_secret() -> None:
    """The admin API (router.api.admin_port) is served on the router pods' fs-admin port,
    reached through its own ClusterIP Service (never the API's), by this namespace's pods only
    unless networkPolicy.adminFrom says; admin.existingSecret's tokens file is mounted and
    named in the settings."""
    docs = render(values_of(None, admin={"existingSecret": "fs-admin-tokens"}))
    settings = serve_config(docs)["applications"][0]["args"]["settings"]
    api = settings["router"]["api"]
    assert (api["admin_host"], api["admin_port"]) == ("0.0.0.0", 9466)
    assert api["admin_tokens_file"] == "/etc/fairserve/admin/admin-tokens.yaml"
    (admin,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("admin")]
    assert admin["spec"]["type"] == "ClusterIP"
    assert admin["spec"]["selector"]["app.kubernetes.io/component"] == "routers"
    assert admin["spec"]["ports"] == [{"name": "admin", "port": 9466, "targetPort": "fs-admin"}]
    spec = rayservice(docs)["spec"]["rayClusterConfig"]
    (routers,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "routers"]
    pod = routers["template"]["spec"]
    assert {"name": "fs-admin", "containerPort": 9466} in pod["containers"][0]["ports"]
    assert {"name": "admin-tokens", "mountPath": "/etc/fairserve/admin", "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "admin-tokens"]
    assert volume["secret"]["secretName"] == "fs-admin-tokens"
    _, ray_np = of_kind(docs, "NetworkPolicy")
    rule = next(r for r in ray_np["spec"]["ingress"]
                if {"protocol": "TCP", "port": 9466} in r.get("ports", []))
    assert rule["from"] == [{"podSelector": {}}]
    for service in of_kind(docs, "Service"):
        if service is not admin:
            assert 9466 not in [p.get("port") for p in service["spec"].get("ports", [])]
    ops = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}]
    docs = render(values_of(None, networkPolicy={"adminFrom": ops},
                            admin={"service": {"type": "NodePort"}}))
    _, ray_np = of_kind(docs, "NetworkPolicy")
    rule = next(r for r in ray_np["spec"]["ingress"]
                if {"protocol": "TCP", "port": 9466} in r.get("ports", []))
    assert rule["from"] == ops
    off = of_kind(render(values_of(None, admin={"service": {"enabled": False}})), "Service")
    assert not [s for s in off if s["metadata"]["name"].endswith("admin")]
