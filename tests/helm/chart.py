"""Rendering the chart with the real Helm engine (helm-python-sdk), offline: the values profiles
of ``helm/fairserve/ci/``, overrides, release names; and picking objects out of a render."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "fairserve"
PROFILES = sorted(p.stem.removesuffix("-values") for p in (CHART_DIR / "ci").glob("*.yaml"))
NAMESPACE = "llm"
# what an operator's values always carry in these tests: a Redis password Secret, and no CRD
# preflight (the offline engine knows only the built-in API groups)
BASE = {"preflight": {"requireKubeRayCRDs": False},
        "redis": {"embedded": {"auth": {"existingSecret": "fairserve-redis"}}}}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a key twice (Helm and PyYAML would silently
    keep the last one: a second `env:` would drop the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate keys {sorted(map(str, duplicates))}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


@functools.cache
def _chart() -> Any:
    helm_python.disable_logging()
    return helm_python.Chart.load(str(CHART_DIR))


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of values: maps merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def profile(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    return yaml.safe_load((CHART_DIR / "ci" / f"{name}-values.yaml").read_text()) or {}


def values_of(profile_name: str | None = None, **overrides: Any) -> dict[str, Any]:
    return merge(merge(BASE, profile(profile_name)), overrides)


def render_files(values: dict[str, Any], release: str = "demo") -> dict[str, str]:
    """Template path -> rendered text (empty templates left out)."""
    out = _chart().render(values, name=release, namespace=NAMESPACE)
    return {path: text for path, text in out.items() if text.strip()}


def render(values: dict[str, Any], release: str = "demo", with_tests: bool = False
           ) -> list[dict[str, Any]]:
    """The manifests of a release (NOTES.txt left out; helm test hooks only if asked)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render_files(values, release).items()):
        if path.endswith("NOTES.txt") or ("/tests/" in path and not with_tests):
            continue
        docs.extend(d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d)
    return docs


def notes(values: dict[str, Any], release: str = "demo") -> str:
    return next((t for p, t in render_files(values, release).items()
                 if p.endswith("NOTES.txt")), "")


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def rayservice(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = of_kind(docs, "RayService")
    return found


def serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])
    return config
