"""The boundary between the router and the model replicas: they meet in ``replicas.protocol``
alone (the design: neither imports the other's internals, and the router never loads
torch). Read from the source (every import statement, those under ``TYPE_CHECKING`` and inside
functions included), and checked in a fresh interpreter for what an import really loads.

- ``router/`` imports of ``replicas`` only ``replicas.protocol`` and its modules.
- ``replicas/`` outside the protocol imports nothing of ``router``: what a replica does in the
  router's structures is handed to it (``replicas.protocol.ReplicaServices``).
- ``replicas/protocol/`` imports nothing of ``router`` nor of the rest of ``replicas``, and no
  torch or transformers.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = "replicas.protocol"
HEAVY = ("torch", "transformers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file; ``from a import b`` yields ``a.b`` too (b
    may be a module), relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(package: str) -> Iterator[str]:
    for path in sorted((REPO / package).rglob("*.py")):
        module = _module_name(path)
        for line, name in _imported(path):
            problem = _problem(module, name)
            if problem:
                yield f"{path.relative_to(REPO)}:{line}: {name}: {problem}"


def _problem(module: str, name: str) -> str | None:
    if _within(module, "router"):
        if _within(name, "replicas") and name != "replicas" and not _within(name, PROTOCOL):
            return f"the router imports of the replicas only {PROTOCOL}"
        return None
    if _within(module, PROTOCOL):
        if _within(name, "router"):
            return "the protocol imports nothing of the router"
        if _within(name, "replicas") and name != "replicas" and not _within(name, PROTOCOL):
            return "the protocol imports nothing of the rest of replicas"
        if any(_within(name, heavy) for heavy in HEAVY):
            return "the protocol stays light (a router imports it)"
        return None
    if _within(module, "replicas") and _within(name, "router"):
        return f"the replicas import nothing of the router (it is injected: {PROTOCOL}.services)"
    return None


@pytest.mark.parametrize("package", ["router", "replicas"])
def test_the_router_and_the_replicas_meet_only_in_the_protocol(package: str) -> None:
    assert any((REPO / package).rglob("*.py"))
    assert list(_violations(package)) == []


@pytest.mark.parametrize("module, importer, name, problem", [
    ("router.service", "replicas.server", "", True),
    ("router.service", "replicas", "engine", True),
    ("router.service", "replicas.protocol.call", "", False),
    ("replicas.server", "router.errors", "", True),
    ("replicas.torch_engine.guide", "replicas.protocol", "", False),
    ("replicas.protocol.services", "replicas.engine.interface", "", True),
    ("replicas.protocol.grammar", "torch", "", True),
])
def test_the_rules_catch_what_they_should(module: str, importer: str, name: str,
                                          problem: bool) -> None:
    target = f"{importer}.{name}" if name else importer
    assert (_problem(module, target) is not None) is problem


@pytest.mark.parametrize("module, forbidden", [
    ("replicas.protocol", ("torch", "transformers", "router", "replicas.engine",
                           "replicas.torch_engine", "replicas.vllm_engine", "replicas.server")),
    ("router.server", ("torch", "transformers", "replicas.engine", "replicas.torch_engine",
                       "replicas.vllm_engine", "replicas.server")),
])
def test_importing_loads_no_torch_and_nothing_across(module: str,
                                                     forbidden: tuple[str, ...]) -> None:
    """Torch costs a router seconds of start-up and some 300 MB."""
    code = (f"import json, sys; import {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if any(m == f or "
            f"m.startswith(f + '.') for f in {list(forbidden)!r}))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
