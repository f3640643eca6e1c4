"""``fairserve up`` on a fresh state directory, then ``status`` and ``down``: the commands the
README starts with, run as a user runs them (a subprocess), against the real model."""

from __future__ import annotations

import re
import socket

import openai
import pytest

from tests.cluster.factories import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_up_prints_a_working_key_and_url_then_status_and_down(tmp_path) -> None:
    up = UpProcess(tmp_path)
    try:
        out = up.wait_ready()
        assert "loading the model" in out and "ready in" in out, out
        base = re.search(r"base URL: (\S+)", out).group(1)
        key = re.search(r"API key:\s+(\S+)", out).group(1)
        assert base == f"http://127.0.0.1:{up.port}/v1"
        assert f"curl {base}/chat/completions" in out and "from openai import OpenAI" in out
        assert (tmp_path / "demo-key").read_text().strip() == key
        assert oct((tmp_path / "demo-key").stat().st_mode & 0o777) == "0o600"
        reply = openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "Which city is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        status = up.cli("status", "--state-dir", str(tmp_path))
        assert status.returncode == 0, status.stdout + status.stderr
        assert "replicas: 1 on 1 node(s)" in status.stdout and "demo" in status.stdout
        assert f"{socket.gethostname()}/" in status.stdout  # where the replica runs
        assert "redis: primary, 0 replica(s)" in status.stdout
        assert "ray nodes: 1 alive, 0 lost, 0 removed" in status.stdout  # the routers publish
        assert re.search(r"routers: 1\n  router-\S+ +" + re.escape(socket.gethostname()) + "/",
                         status.stdout), status.stdout
        down = up.cli("down", "--state-dir", str(tmp_path))
        assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
        assert up.process.wait(timeout=60) == 0
        assert not (tmp_path / "run.json").exists()
    finally:
        up.kill()
