"""Every render of the chart against what Kubernetes, KubeRay and the security bar take:
kubernetes-validate (strict) on the built-in objects, the RayService against the KubeRay CRD
(made strict), its pod templates as PodTemplates, the controller rules the CRD does not encode,
the security walk (every container, Ray's included; no secret in args, env values or
serveConfigV2) and checkov, run offline in its own virtual environment."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import PROFILES, REPO, rayservice, render, values_of
from tests.helm.validators import (
    builtin_problems,
    checkov_problems,
    kuberay_rule_problems,
    pod_template_problems,
    pod_templates,
    rayservice_crd_problems,
    security_problems,
)

CHECKOV_CONFIG = REPO / "helm" / ".checkov.yaml"
VARIANTS = {name: values_of(name) for name in PROFILES} | {
    "incremental": values_of(None, upgrade={"strategy": "NewClusterWithIncrementalUpgrade",
                                            "incremental": {"gatewayClassName": "istio"}}),
    "no-auth-redis": values_of(None, redis={"embedded": {"auth": {"enabled": False}}}),
    "pvc-model": values_of(None, model={"source": "pvc", "path": "/models/m.gguf"}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_builtin_objects_pass_kubernetes_strict_validation(name: str) -> None:
    problems = builtin_problems(render(VARIANTS[name], with_tests=True))
    assert not problems, problems


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rayservice_passes_the_strict_crd_schema_and_the_controller_rules(name: str) -> None:
    service = rayservice(render(VARIANTS[name]))
    assert not rayservice_crd_problems(service), rayservice_crd_problems(service)
    assert not pod_template_problems(service), pod_template_problems(service)
    assert not kuberay_rule_problems(service), kuberay_rule_problems(service)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_security_walk_over_every_container(name: str) -> None:
    problems = security_problems(render(VARIANTS[name], with_tests=True))
    assert not problems, problems


def _checkov_bin() -> str | None:
    for candidate in (os.environ.get("CHECKOV_BIN"), str(REPO / ".venv-checkov/bin/checkov")):
        if candidate and Path(candidate).is_file():
            return str(Path(candidate).resolve())  # checkov runs in a directory of its own
    return shutil.which("checkov")


def test_checkov_finds_no_failed_check(tmp_path: Path) -> None:
    checkov = _checkov_bin()
    if checkov is None:
        if os.environ.get("CI"):
            pytest.fail("checkov is missing: `make test` installs it in .venv-checkov")
        pytest.skip("no checkov: `make test` installs it in .venv-checkov (CI fails here)")
    count = 0
    for name, values in sorted(VARIANTS.items()):
        docs = render(values, with_tests=True)
        docs += pod_templates(rayservice(docs))  # checkov does not look inside the RayService
        for doc in docs:
            count += 1
            (tmp_path / f"{name}-{count:03d}.yaml").write_text(yaml.safe_dump(doc))
    report = checkov_problems(tmp_path, checkov, CHECKOV_CONFIG)
    assert report.checks_run, "checkov ran no check"
    assert not report.problems, report.problems
