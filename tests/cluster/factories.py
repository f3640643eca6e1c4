"""``fairserve up`` as a user runs it: a child process, its output read until it is ready and
drained after (a full pipe would block it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from cluster.redis_server import free_port

UP_TIMEOUT_S = 400


class UpProcess:
    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.env = {**os.environ, "FAIRSERVE_REDIS__PORT": str(free_port()),
                    "FAIRSERVE_RAY__NUM_CPUS": "2", "FAIRSERVE_ENGINE__NUM_THREADS": "1",
                    **(env or {})}
        self.state_dir = state_dir
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "up", "--state-dir", str(state_dir),
             "--port", str(self.port), *args], env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_ready(self) -> str:
        """Its output up to the ready banner; afterwards the output is drained in a thread."""
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

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
