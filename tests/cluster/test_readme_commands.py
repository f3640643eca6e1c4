"""The README's first commands, run literally: a fresh ``git clone``, ``make up`` from its root
with no flags, a chat completion with the key it prints, ``fairserve status`` and ``down`` from
the same directory; ``make up`` again on the same state after tens of MB of history; and
``fairserve up`` from a subdirectory with a relative settings file, tenants file and state dir.

The clone is of this working tree (uncommitted changes carried over, so the test checks what
is on disk; in CI the two are the same). It reuses the suite's virtual environment as its
``.venv`` (the Makefile then finds it installed and goes straight to ``fairserve up``), and runs
the clone's own code (``PYTHONPATH``), not the tree that environment was installed from. The
environment is the suite's without any ``FAIRSERVE_*``/``RAY_*``/``OTEL_*``/``MAKE*`` variable,
except the suite's own model cache directory (tests write nothing under ``~/.cache``).
The default ports (8000 for HTTP, 6390 for the embedded Redis) must be free.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import redis
import yaml

from cluster.ports import free_port
from tests.cluster.factories import ForegroundProcess, fill_redis

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
HISTORY_BYTES = 40 * 1024 * 1024
DEFAULT_PORTS = (8000, 6390)
STRIPPED_ENV = ("FAIRSERVE_", "RAY_", "OTEL_", "MAKE", "MFLAGS")
LONG_AGO = 946684800  # 2000-01-01: older than the venv's install stamp


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = Path(sys.prefix)
    if not (venv / ".installed-stamp").is_file():
        pytest.skip("needs the Makefile's .venv (run the suite with `make test`)")
    dest = tmp_path_factory.mktemp("readme") / "fairserve"
    _git("clone", "-q", str(REPO), str(dest))
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=REPO, check=True,
                          capture_output=True).stdout
    if diff:
        subprocess.run(["git", "apply", "--whitespace=nowarn"], cwd=dest, input=diff, check=True)
    for name in _git("ls-files", "-o", "--exclude-standard", "-z").split("\0"):
        if name:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes((REPO / name).read_bytes())
    (dest / ".venv").symlink_to(venv)
    for name in ("Makefile", "pyproject.toml"):  # the install stamp is newer: no reinstall
        os.utime(dest / name, (LONG_AGO, LONG_AGO))
    return dest


def newcomer_env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED_ENV)}
    env["FAIRSERVE_CACHE_DIR"] = os.environ["FAIRSERVE_CACHE_DIR"]  # tests/conftest.py
    env["PYTHONPATH"] = str(clone)
    return env


def fairserve(clone: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(clone / ".venv" / "bin" / "fairserve"), *args], cwd=cwd,
                          env=newcomer_env(clone), text=True, capture_output=True, timeout=180)


def ask_capital(base_url: str, key: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}])
    return reply.choices[0].message.content or ""


def count_history(client: redis.Redis) -> int:
    return sum(1 for _ in client.scan_iter(match="history:*", count=10_000))


def make_up(clone: Path) -> tuple[ForegroundProcess, str, str, str]:
    """``make up`` in the clone's root; its process, output, base URL and printed key."""
    up = ForegroundProcess(["make", "up"], env=newcomer_env(clone), cwd=clone)
    out = up.wait_ready()
    banner = re.search(r"base URL: (\S+)\nAPI key:\s+(\S+)", out)
    if banner is None:
        up.kill()
        pytest.fail(f"`make up` did not serve:\n{out}")
    return up, out, banner.group(1), banner.group(2)


def stop(up: ForegroundProcess, clone: Path, cwd: Path, *args: str) -> None:
    down = fairserve(clone, cwd, "down", *args)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
    assert up.process.wait(timeout=120) == 0, "".join(up.lines)


def test_make_up_in_a_fresh_clone_then_again_on_a_large_history(clone: Path) -> None:
    for port in DEFAULT_PORTS:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is in use: stop it"
    state = clone / ".fairserve"
    up, out, base, key = make_up(clone)
    try:
        assert base == "http://127.0.0.1:8000/v1" and "placement: 1 model replica(s)" in out
        assert (state / "demo-key").read_text().strip() == key
        assert "Paris" in ask_capital(base, key)
        status = fairserve(clone, clone, "status")
        assert status.returncode == 0 and "demo" in status.stdout, status.stdout + status.stderr
        run_state = yaml.safe_load((state / "run.json").read_text())
        history = redis.Redis.from_url(run_state["redis_url"])
        assert fill_redis(history, HISTORY_BYTES) >= 0.9 * HISTORY_BYTES
        num_history = count_history(history)
        history.close()
        stop(up, clone, clone)
    finally:
        up.kill()
    assert (state / "redis" / "appendonly.aof").stat().st_size >= 0.9 * HISTORY_BYTES

    again, _, base, same_key = make_up(clone)
    try:
        assert same_key == key  # the same tenant and key, kept in Redis and the state dir
        assert "Paris" in ask_capital(base, key)
        run_state = yaml.safe_load((state / "run.json").read_text())
        assert count_history(redis.Redis.from_url(run_state["redis_url"])) == num_history
        stop(again, clone, clone)
    finally:
        again.kill()


def test_up_from_a_subdirectory_with_relative_settings_tenants_and_state(clone: Path) -> None:
    conf = clone / "conf"
    conf.mkdir()
    (conf / "tenants.yaml").write_text("tenants:\n  - {id: acme, weight: 2}\n")
    # paths in the file are relative to it; two replicas with their CPUs left to the machine
    (conf / "fairserve.yaml").write_text(yaml.safe_dump({
        "tenants": {"file": "tenants.yaml"}, "replicas": {"num_replicas": 2},
        "router": {"port": free_port()}, "redis": {"port": free_port()}}))
    sub = clone / "work"
    sub.mkdir()
    up = ForegroundProcess(
        [str(clone / ".venv" / "bin" / "fairserve"), "up", "--config", "../conf/fairserve.yaml",
         "--state-dir", "../state-b"], env=newcomer_env(clone), cwd=sub)
    try:
        out = up.wait_ready()
        assert "tenants from" in out and "1 created" in out, out
        assert "placement: 2 model replica(s) x 0.87 CPU" in out, out
        base = re.search(r"base URL: (\S+)", out)
        assert base is not None, out
        redis_url = yaml.safe_load((clone / "state-b" / "run.json").read_text())["redis_url"]
        created = fairserve(clone, sub, "tenants", "key-create", "acme", "--redis-url", redis_url)
        assert created.returncode == 0, created.stdout + created.stderr
        key = re.search(r"fs-\S+", created.stdout)
        assert key is not None, created.stdout
        assert "Paris" in ask_capital(base.group(1), key.group(0))
        status = fairserve(clone, sub, "status", "--state-dir", "../state-b")
        assert "replicas: 2" in status.stdout and "acme" in status.stdout, status.stdout
        stop(up, clone, sub, "--config", "../conf/fairserve.yaml", "--state-dir", "../state-b")
    finally:
        up.kill()
    assert (clone / "state-b" / "redis" / "appendonly.aof").is_file()
    assert not (sub / ".fairserve").exists()


def test_a_configuration_that_cannot_be_placed_fails_at_once_with_the_numbers(
        clone: Path) -> None:
    env = {**newcomer_env(clone), "FAIRSERVE_REPLICAS__NUM_REPLICAS": "2",
           "FAIRSERVE_REPLICAS__NUM_CPUS": "1", "FAIRSERVE_RAY__NUM_CPUS": "2"}
    failed = subprocess.run(["make", "up"], cwd=clone, env=env, text=True, capture_output=True,
                            timeout=120)
    assert failed.returncode != 0
    assert ("2 model replica(s) x 1 CPU + 1 router(s) x 0.25 CPU = 2.25 CPU asked, "
            "2 CPU available") in failed.stderr, failed.stdout + failed.stderr
    assert "loading the model" not in failed.stdout  # nothing was deployed
