"""``fairserve up`` (or ``make up``) as a user runs it: a child process, its output read until it
is ready and drained after (a full pipe would block it); and a Redis filled with history."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from cluster.ports import free_port

UP_TIMEOUT_S = 400


class ForegroundProcess:
    """A command that serves in the foreground (``make up``, ``fairserve up``), in its own
    process group; its output is read until the ready banner, and drained after."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.env = env
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            command, cwd=cwd, env=env, text=True, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_ready(self) -> str:
        """Its output up to the ready banner (or its end); afterwards drained in a thread."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            line = stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if "Ctrl-C" in line:
                break
        threading.Thread(target=lambda: [self.lines.append(x) for x in stdout],
                         daemon=True).start()
        return "".join(self.lines)

    def kill(self) -> None:
        """SIGKILL to the whole group (``make`` and the ``fairserve`` it runs)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class UpProcess(ForegroundProcess):
    """``fairserve up`` as the suite runs it: its own state directory and free ports."""

    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.state_dir = state_dir
        super().__init__(
            [sys.executable, "-m", "cluster.cli", "up", "--state-dir", str(state_dir),
             "--port", str(self.port), *args],
            env={**os.environ, "FAIRSERVE_REDIS__PORT": str(free_port()),
                 "FAIRSERVE_ROUTER__API__METRICS_PORT": str(free_port()),
                 "FAIRSERVE_RAY__NUM_CPUS": "2", "FAIRSERVE_ENGINE__NUM_THREADS": "1",
                 **(env or {})})

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cluster.cli", *args], env=self.env,
                              text=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        """``fairserve down``, as a user stops it; killed if that fails."""
        if self.process.poll() is None:
            self.cli("down", "--state-dir", str(self.state_dir))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=60)
        self.kill()


def fill_redis(client: redis.Redis, num_bytes: int) -> int:
    """Write about ``num_bytes`` of history into Redis as many small hashes (what an AOF holds
    after hours of use: many small commands, slow to replay); returns the AOF's size."""
    payload = os.urandom(40).hex()
    pipe = client.pipeline(transaction=False)
    num_written = 0
    i = 0
    while num_written < num_bytes:
        pipe.hset(f"history:{{t{i % 50}}}:{i}", mapping={"body": payload, "n": i})
        num_written += 160  # the AOF's bytes per such command
        i += 1
        if i % 5000 == 0:
            pipe.execute()
    pipe.execute()
    return int(client.info("persistence")["aof_current_size"])
