"""Building the CPU kernels survives what a killed build leaves behind and a cache directory it
cannot write: it never hangs and never crashes the engine (each in a fresh interpreter, with
its own cache directory, as a replica starting on a machine would)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

BUILD = """
import sys
from replicas.torch_engine import kernels
kernels.BUILD_LOCK_TIMEOUT_S = float(sys.argv[1])
if sys.argv[2] == "stale":  # what a build killed mid-way leaves: torch's lock file
    directory = kernels.cache_root() / kernels.build_key()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")
status = kernels.cpu_ops()
print("STATUS", status.is_available, status.detail)
"""


def build(cache: Path, timeout_lock_s: float, mode: str, timeout_s: float = 300
          ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run([sys.executable, "-c", BUILD, str(timeout_lock_s), mode], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)


def status_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("STATUS")]
    assert lines, result.stdout + result.stderr
    return lines[-1]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path: Path) -> None:
    result = build(tmp_path / "cache", 600, "stale")
    assert status_line(result).startswith("STATUS True"), result.stderr[-2000:]
    assert "removing a kernel build lock left by a build that died" in result.stderr


def test_an_unwritable_cache_falls_back_to_the_torch_path(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    result = build(not_a_directory, 600, "plain", timeout_s=120)
    line = status_line(result)
    assert line.startswith("STATUS False") and "cannot be written" in line, line
    assert result.returncode == 0


def test_a_build_lock_held_too_long_gives_up_with_a_reason(tmp_path: Path) -> None:
    """Another live process holding fairserve's lock (a build that hangs) is waited for, up to
    the timeout, then the engine goes on without the kernels."""
    probe = subprocess.run(
        [sys.executable, "-c", "from replicas.torch_engine import kernels; "
         "print(kernels.cache_root() / kernels.build_key())"], cwd=ROOT, check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)}, capture_output=True, text=True)
    directory = Path(probe.stdout.strip())
    directory.mkdir(parents=True)
    with (directory / "fairserve.lock").open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        result = build(tmp_path, 1.0, "plain", timeout_s=120)
    line = status_line(result)
    assert line.startswith("STATUS False") and "held the build lock" in line, line
