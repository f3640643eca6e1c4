"""fairserve's CPU kernels (``cpu_ops.cpp``), compiled for this machine on first use.

NOTE: the kernels are compiled by torch's C++ extension builder (g++ and ninja) with
``-march=native`` the first time an engine on this machine needs them (about 11 s on 2
cores), into ``~/.cache/fairserve/kernels/<key>``; ``key`` hashes the source, torch's version,
the compiler and the CPU's flags, so a cache copied to another CPU (or an image run on another
machine) is rebuilt, never run with instructions the CPU lacks. Concurrent replicas wait on
fairserve's own build lock (``flock`` on ``fairserve.lock``: the kernel drops it when its
holder dies, so a replica killed mid-build leaves nothing behind; the wait is capped at
``BUILD_LOCK_TIMEOUT_S``) and load the same library. Torch's own lock file (``lock``, which a
killed build leaves behind, and which made every later start wait for ever) is removed by
whoever holds fairserve's lock: under it, no other build is running. Where they cannot be
built (no compiler, a cache directory that cannot be written), the engine runs its torch path (``models/llama.py``): same model, slower, and float32 only by
default (``device_choice.py``); the reason is logged once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
OPS = ("rms_norm", "add_rms_norm", "silu_mul", "paged_attention", "lora_apply")
BUILD_LOCK_TIMEOUT_S = 600.0  # another process building longer than this is stuck
BUILD_LOCK_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class KernelStatus:
    is_available: bool
    detail: str  # where the library is, or why it is not there


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fairserve" / "kernels"


def build_key() -> str:
    """What the compiled library depends on: source, torch, compiler and CPU."""
    from replicas.torch_engine.device_choice import cpu_flags  # device_choice imports this package

    compiler = _compiler_version()
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), compiler.encode(),
                 " ".join(sorted(cpu_flags())).encode(), " ".join(CFLAGS).encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@cache
def cpu_ops() -> KernelStatus:
    """Build (once per machine) and load the kernels into ``torch.ops.fairserve``."""
    if _registered():
        return KernelStatus(True, "already loaded")
    _find_venv_ninja()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return _unavailable(f"no {' or '.join(missing)} on PATH to build them")
    from torch.utils import cpp_extension

    key = build_key()
    directory = cache_root() / key
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = (directory / "fairserve.lock").open("a")
    except OSError as exc:
        return _unavailable(f"the kernel cache {directory} cannot be written: {exc}")
    started = time.perf_counter()
    with lock:
        if not _acquire(lock.fileno(), BUILD_LOCK_TIMEOUT_S):
            return _unavailable(f"another process held the build lock in {directory} for "
                                f"{BUILD_LOCK_TIMEOUT_S:.0f} s")
        stale = directory / "lock"  # torch's; with fairserve's lock held, no build is running
        if stale.exists():
            logger.warning("removing a kernel build lock left by a build that died: %s", stale)
            stale.unlink(missing_ok=True)
        try:
            cpp_extension.load(
                name=f"fairserve_cpu_ops_{key}", sources=[str(SOURCE)],
                extra_cflags=list(CFLAGS), build_directory=str(directory),
                is_python_module=False, verbose=False,
            )
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
            return _unavailable(f"the build failed: {(errors or [str(exc)])[0][:500]}")
    logger.info("CPU kernels loaded from %s in %.1f s", directory, time.perf_counter() - started)
    return KernelStatus(True, str(directory))


def _acquire(fd: int, timeout_s: float) -> bool:
    """An exclusive ``flock`` on ``fd`` within ``timeout_s`` (released when the file is closed,
    or by the kernel when the process dies)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(BUILD_LOCK_POLL_S)


def _find_venv_ninja() -> None:
    """The ``ninja`` wheel (a dependency) puts its binary beside this Python, which is not on
    PATH when the venv's python is run without activating it; torch's builder looks on PATH."""
    beside = Path(sys.executable).parent / "ninja"
    if shutil.which("ninja") is None and beside.exists():
        os.environ["PATH"] = f"{beside.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def _registered() -> bool:
    try:
        return all(hasattr(torch.ops.fairserve, op) for op in OPS)
    except (AttributeError, RuntimeError):
        return False


def _unavailable(reason: str) -> KernelStatus:
    logger.warning("fairserve's CPU kernels are not available (%s): the engine runs its torch "
                   "path, slower and float32 by default", reason)
    return KernelStatus(False, reason)


def _compiler_version() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True,
                              timeout=30, check=False).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


__all__ = ["KernelStatus", "build_key", "cache_root", "cpu_ops"]
