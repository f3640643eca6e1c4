"""The peer of the CPU benchmark: llama.cpp's ``llama-server``, built from the llama.cpp that
the ``llama-cpp-python`` sdist vendors, and run on the same GGUF file.

The build (cmake, CPU only, with the AVX2 / AVX-512 / AVX-512 BF16 / VNNI kernels this CPU's
flags name, as our engine uses them) is cached under ``$FAIRSERVE_CACHE_DIR/peer`` (else ``~/.cache/fairserve/peer``):
minutes the first time, nothing after. Where it cannot be built (no compiler, no cmake, no
registry to fetch the sdist from), ``build`` returns ``None`` with the reason: the benchmark
then runs without the peer and says so; it never stands anything else in for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from replicas.torch_engine.device_choice import cpu_flags

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Built:
    binary: Path | None
    reason: str  # what was built, or why nothing was


def cache_dir() -> Path:
    root = os.environ.get("FAIRSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "fairserve")
    return Path(root) / "peer"


def build(log: Path | None = None) -> Built:
    """``llama-server`` of llama-cpp-python ``SDIST_VERSION``'s vendored llama.cpp."""
    home = cache_dir() / f"llama-cpp-{SDIST_VERSION}-noamx"
    binary = home / "build" / "bin" / "llama-server"
    if binary.is_file():
        return Built(binary, f"cached build of {SDIST} {SDIST_VERSION}'s llama.cpp")
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tool) is None]
    if missing:
        return Built(None, f"cannot build llama-server: {', '.join(missing)} not installed")
    home.mkdir(parents=True, exist_ok=True)
    out = open(log or home / "build.log", "w")  # noqa: SIM115 - the subprocesses write to it
    try:
        source = _vendored_source(home, out)
        if source is None:
            return Built(None, f"cannot build llama-server: pip could not fetch the {SDIST} "
                               f"sdist (see {out.name})")
        configure = ["cmake", "-S", str(source), "-B", str(home / "build"),
                     "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_SERVER=ON", *isa_options(cpu_flags())]
        jobs = str(os.cpu_count() or 2)
        for step in (configure, ["cmake", "--build", str(home / "build"), "--target",
                                 "llama-server", "-j", jobs]):
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                return Built(None, f"cannot build llama-server: {step[0]} {step[1]} failed "
                                   f"(see {out.name})")
    finally:
        out.close()
    return Built(binary, f"built from {SDIST} {SDIST_VERSION}'s llama.cpp")


def isa_options(flags: frozenset[str]) -> list[str]:
    """cmake options for the x86 kernels this CPU has. Not ``GGML_NATIVE``: on a 2-core Xeon VM
    with AMX the native build died of SIGILL (-4) as its server started; this one, naming the
    AVX-512 kernels (BF16, VNNI) and leaving AMX out, runs there."""
    wanted = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
              "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
              "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
    return ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in flags else 'OFF'}"
                                    for option, flag in wanted.items()]


def _vendored_source(home: Path, out: IO[str]) -> Path | None:
    archive = next(home.glob("*.tar.gz"), None)
    if archive is None:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--dest", str(home), f"{SDIST}=={SDIST_VERSION}"],
            stdout=out, stderr=subprocess.STDOUT)
        archive = next(home.glob("*.tar.gz"), None)
        if fetched.returncode != 0 or archive is None:
            return None
    with tarfile.open(archive) as tar:
        tar.extractall(home, filter="data")
    return next(home.glob("llama_cpp_python-*/vendor/llama.cpp"))


class LlamaServer:
    """A running ``llama-server`` on ``model`` with ``threads`` threads and ``parallel`` slots,
    each with room for ``slot_tokens`` tokens."""

    def __init__(self, binary: Path, model: str, port: int, threads: int, parallel: int,
                 slot_tokens: int) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = open(cache_dir() / "server.log", "w")  # noqa: SIM115 - the server writes it
        self.process = subprocess.Popen(
            [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port),
             "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
             "-c", str(parallel * slot_tokens), "--no-webui"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.process.returncode}; see "
                                   f"{self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready in {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
