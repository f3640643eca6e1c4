"""``fairserve down``/``status``/``top`` find the state directory ``fairserve up`` used, from
any directory, without loading the settings tree (which imports torch)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from cluster.cli import _state_dir


def args(state_dir: str | None = None, config: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(state_dir=state_dir, config=config)


def test_the_state_dir_is_found_as_up_found_it(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FAIRSERVE_STATE_DIR", raising=False)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "f.yaml").write_text("state_dir: ../state\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert _state_dir(args()) == tmp_path / "sub" / ".fairserve"
    assert _state_dir(args(state_dir="../s")) == tmp_path / "s"
    assert _state_dir(args(config="../conf/f.yaml")) == tmp_path / "state"
    monkeypatch.setenv("FAIRSERVE_STATE_DIR", "env-state")
    assert _state_dir(args(config="../conf/f.yaml")) == tmp_path / "sub" / "env-state"
    assert _state_dir(args(state_dir="../s")) == tmp_path / "s"  # the flag wins


def test_down_from_a_subdirectory_with_a_relative_state_dir_names_it(tmp_path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "run.json").write_text(json.dumps({"pid": 2 ** 22 + 7, "base_url": "x",
                                                "redis_url": "y"}))
    (tmp_path / "sub").mkdir()
    down = subprocess.run([sys.executable, "-m", "cluster.cli", "down", "--state-dir", "../state"],
                          cwd=tmp_path / "sub", capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin"})
    assert down.returncode == 1 and f"(pid {2 ** 22 + 7}) is not running" in down.stderr
    status = subprocess.run([sys.executable, "-m", "cluster.cli", "status"],
                            cwd=tmp_path / "sub", capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin"})
    assert status.returncode == 1 and str(tmp_path / "sub" / ".fairserve") in status.stdout
