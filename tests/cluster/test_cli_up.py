"""``fairserve up`` on a fresh state directory, then ``status`` and ``down``: the commands the
README starts with, run as a user runs them (a subprocess), against the real model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import openai
import pytest

from cluster.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UP_TIMEOUT_S = 400


def _fairserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)


def test_up_prints_a_working_key_and_url_then_status_and_down(tmp_path) -> None:
    env = {**os.environ, "FAIRSERVE_REDIS__PORT": str(free_port()),
           "FAIRSERVE_RAY__NUM_CPUS": "2", "FAIRSERVE_ENGINE__NUM_THREADS": "1"}
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", "--state-dir", str(tmp_path),
                           "--port", str(port)], env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    lines: list[str] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        out = "".join(lines)
        # keep draining its output, or a full pipe would block it (Ray logs as it shuts down)
        drain = threading.Thread(target=lambda: [lines.append(x) for x in up.stdout], daemon=True)
        drain.start()
        assert "loading the model" in out and "ready in" in out, out
        base = re.search(r"base URL: (\S+)", out).group(1)
        key = re.search(r"API key:\s+(\S+)", out).group(1)
        assert base == f"http://127.0.0.1:{port}/v1"
        assert f"curl {base}/chat/completions" in out and "from openai import OpenAI" in out
        assert (tmp_path / "demo-key").read_text().strip() == key
        assert oct((tmp_path / "demo-key").stat().st_mode & 0o777) == "0o600"
        reply = openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        status = _fairserve("status", "--state-dir", str(tmp_path), env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "replicas: 1" in status.stdout and "demo" in status.stdout
        down = _fairserve("down", "--state-dir", str(tmp_path), env=env)
        assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
        assert up.wait(timeout=60) == 0
        assert not (tmp_path / "run.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
