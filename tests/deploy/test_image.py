"""The CPU container image, built and run as it is shipped.

``deploy/images/build.sh`` builds it (buildah, a debootstrap base; many minutes the first time,
cached layers after); then ``fairserve up`` runs in a buildah container the way KubeRay starts a
Ray container (``/bin/bash -lc -- "ulimit -n 65536; ..."``, as the image's user), and this test
process, outside, asks it a question with the ``openai`` SDK on 127.0.0.1. Chroot isolation
shares the host's network (the router binds 0.0.0.0 on a free port) and its PID namespace, so
the processes inside are seen, and their owner checked, from here.

Marker ``image``: needs root, buildah and debootstrap; it runs only with ``-m image``
(tests/deploy/conftest.py), so ``make test`` leaves it out. The measurements (build, size,
start to ready) are printed: run with ``-s`` to see them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.ports import free_port

pytestmark = [pytest.mark.image, pytest.mark.timeout(5400)]

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "deploy" / "images" / "build.sh"
BUILDAH = ["buildah", "--storage-driver", os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")]
BUILD_TIMEOUT_S = 3600.0
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
RAY_UID, RAY_GID = 1000, 100
VENV_BIN = "/opt/fairserve/venv/bin"


def _buildah(*args: str, timeout_s: float = 300.0) -> str:
    done = subprocess.run([*BUILDAH, *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"buildah {' '.join(args)}: {done.stderr[-3000:]}"
    return done.stdout


def _in_container(container: str, script: str, timeout_s: float = 120.0) -> str:
    """Output of ``script`` run as KubeRay runs its command: a bash login shell, image's user."""
    return _buildah("run", "--isolation", "chroot", container, "--",
                    "/bin/bash", "-lc", "--", script, timeout_s=timeout_s)


def _report(line: str) -> None:
    print(f"[image] {line}", flush=True)


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        pytest.skip("building images needs root")
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (apt-get install -y buildah debootstrap)")
    started = time.monotonic()
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"build.sh failed:\n{done.stderr[-6000:]}"
    name = done.stdout.strip().splitlines()[-1]
    size = _buildah("images", "--format", "{{.Size}}", name).strip()
    _report(f"build.sh: {time.monotonic() - started:.0f} s; {name}: {size}")
    for line in done.stderr.splitlines():
        if line.startswith("[build.sh"):
            _report(line)
    return name


@pytest.fixture
def container(image: str) -> Iterator[str]:
    name = f"fairserve-image-test-{uuid.uuid4().hex[:8]}"
    _buildah("from", "--name", name, image)
    try:
        yield name
    finally:
        _buildah("rm", name)


def _chroot_of(pid: int) -> str | None:
    """The root directory that ``pid`` or one of its descendants runs in, other than "/"."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # gone meanwhile
            continue
        if not stat:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            root = os.readlink(f"/proc/{current}/root")
        except OSError:
            root = "/"
        if root != "/":
            return root
        todo.extend(children.get(current, []))
    return None


def _pids_in(root: str) -> list[int]:
    """Processes running in the chroot ``root`` (buildah bind-mounts the container's file
    system there for one ``buildah run``; Ray's daemons are not all its descendants)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root").startswith(root):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return pids


def _owner(pid: int) -> tuple[int, int] | None:
    """(real uid, real gid) of ``pid``; None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
    gid = int(re.search(r"^Gid:\s+(\d+)", status, re.M).group(1))
    return uid, gid


class _Background:
    """A command running in the container as KubeRay runs one (a bash login shell, the
    image's user), its output collected by a thread."""

    def __init__(self, container: str, script: str) -> None:
        self.container = container
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [*BUILDAH, "run", "--isolation", "chroot", container, "--",
             "/bin/bash", "-lc", "--", script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.root: str | None = None  # the chroot it runs in, once seen
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, *patterns: str) -> list[re.Match[str]]:
        """The matches of all ``patterns`` (multiline) once the output has them all."""
        deadline = self.started + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = "\n".join(self.lines)
            found = [re.search(pattern, text, re.M) for pattern in patterns]
            if all(found):
                self.root = _chroot_of(self.process.pid)
                return found  # type: ignore[return-value]
            if self.process.poll() is not None:
                self._reader.join(timeout=5)
                tail = "\n".join(self.lines[-60:])
                pytest.fail(f"exited ({self.process.returncode}) before {patterns}:\n{tail}")
            time.sleep(0.5)
        tail = "\n".join(self.lines[-60:])
        pytest.fail(f"no {patterns} in {READY_TIMEOUT_S:.0f} s:\n{tail}")

    def stop(self, stop_script: str | None = None) -> None:
        """``stop_script`` run in the container, else SIGTERM to every process in the chroot;
        whatever is still alive there after that is killed, by pid."""
        if self.process.poll() is None:
            if stop_script is not None:
                subprocess.run([*BUILDAH, "run", "--isolation", "chroot", self.container, "--",
                                "/bin/bash", "-lc", "--", stop_script],
                               capture_output=True, timeout=STOP_TIMEOUT_S + 30)
            else:
                self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self._signal(signal.SIGKILL)  # Ray's daemons, redis-server: none should be left
        self._reader.join(timeout=10)

    def _signal(self, signum: int) -> None:
        for pid in _pids_in(self.root) if self.root else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def test_image_is_a_ray_container(container: str) -> None:
    """Non-root user ray (1000:100), HOME writable, `ray` and the project on a login shell's
    PATH, and the default model's prepared copy found where a replica will look."""
    out = _in_container(container, (
        "id -u; id -g; id -un; echo $HOME; test -w $HOME && echo writable; command -v ray; "
        "command -v fairserve; python -c 'import ray; print(ray.__version__)'; "
        "python -c 'import torch; print(torch.__version__)'; "
        "python -c 'import torch; from replicas.engine.config import EngineConfig; "
        "from replicas.torch_engine.loader.prepared import prepared_dir; c = EngineConfig(); "
        "print(prepared_dir(c.model, torch.float32, c.model_cache_dir).is_dir())'"))
    lines = out.split()
    assert lines[:5] == [str(RAY_UID), str(RAY_GID), "ray", "/home/ray", "writable"], out
    assert lines[5:7] == [f"{VENV_BIN}/ray", f"{VENV_BIN}/fairserve"], out
    assert lines[7] == "2.60.0", out
    assert lines[8] == "2.13.0+cpu", out
    assert lines[9] == "True", "the baked prepared model is not where a replica looks: " + out


def test_fairserve_up_answers_from_the_image(container: str) -> None:
    from openai import OpenAI

    port, redis_port = free_port(), free_port()
    # NOTE: the host's network is shared: the router and the embedded Redis get free ports so
    # that this never meets another cluster on the machine (Ray picks free ports itself).
    up = _Background(container, f"ulimit -n 65536; FAIRSERVE_REDIS__PORT={redis_port} "
                                f"exec fairserve up --host 0.0.0.0 --port {port}")
    try:
        base, key = up.wait_for(r"^base URL: (\S+)", r"^API key:\s+(\S+)")
        base_url, api_key = base.group(1), key.group(1)
        ready = next((line.strip() for line in up.lines if "ready in" in line), "")
        _report(f"fairserve up to ready: {time.monotonic() - up.started:.1f} s ({ready})")
        assert base_url == f"http://127.0.0.1:{port}/v1", base_url

        assert up.root is not None, "no process of fairserve up found in a chroot"
        owners = {pid: _owner(pid) for pid in _pids_in(up.root)}
        owners = {pid: owner for pid, owner in owners.items() if owner is not None}
        assert len(owners) >= 3, f"expected fairserve, Ray and redis-server inside: {owners}"
        assert set(owners.values()) == {(RAY_UID, RAY_GID)}, f"not all uid 1000: {owners}"

        client = OpenAI(base_url=base_url, api_key=api_key, timeout=120, max_retries=0)
        started = time.monotonic()
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": "Which city is the capital of France?"}])
        _report(f"first chat completion: {time.monotonic() - started:.2f} s: "
                f"{reply.choices[0].message.content!r}")
        assert "Paris" in (reply.choices[0].message.content or "")
        # the replica loaded the baked copy: the cache holds no second preparation
        cached = _in_container(container, 'ls -A "$FAIRSERVE_CACHE_DIR/models"').split()
        assert len(cached) == 1, f"the model was prepared again at run time: {cached}"
    finally:
        up.stop("fairserve down")
    assert up.process.returncode is not None
    assert up.root is not None and _pids_in(up.root) == [], "processes left in the container"


def test_ray_head_starts_as_kuberay_starts_it(container: str) -> None:
    """`ray start --head --block` under `bash -lc` with `ulimit -n 65536` first, then
    KubeRay's default head probes (wget on the raylet's and the GCS's health endpoints).
    Every port is a free one, on 127.0.0.1 where Ray allows it."""
    gcs, client, dashboard, agent = (free_port() for _ in range(4))
    head = _Background(container, (
        f"ulimit -n 65536; exec ray start --head --block --port={gcs} --num-cpus=1 "
        f"--node-ip-address=127.0.0.1 --ray-client-server-port={client} "
        f"--dashboard-host=127.0.0.1 --dashboard-port={dashboard} "
        f"--dashboard-agent-listen-port={agent}"))
    probe = (f"wget --tries 1 -T 2 -q -O- http://localhost:{agent}/api/local_raylet_healthz "
             f"| grep success && wget --tries 1 -T 10 -q -O- "
             f"http://localhost:{dashboard}/api/gcs_healthz | grep success")
    try:
        head.wait_for(r"Ray runtime started")
        deadline = time.monotonic() + 120
        while True:
            done = subprocess.run([*BUILDAH, "run", "--isolation", "chroot", container, "--",
                                   "bash", "-c", probe], capture_output=True, text=True,
                                  timeout=60)
            if done.returncode == 0:
                break
            assert time.monotonic() < deadline, f"probes failing: {done.stdout}{done.stderr}"
            time.sleep(2)
        _report(f"ray start --head to probes passing: {time.monotonic() - head.started:.1f} s")
        assert set(filter(None, map(_owner, _pids_in(head.root or "")))) == {(RAY_UID, RAY_GID)}
    finally:
        head.stop()
    assert head.root is not None and _pids_in(head.root) == [], "processes left"
