"""The attention benchmark (cluster/benchmarks/attention_bench.py) runs and finds the same bits
on both paths, on a small shape (the figures themselves are in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replicas.torch_engine.kernels import cpu_ops

STATUS = cpu_ops()


@pytest.mark.skipif(not STATUS.is_available, reason=STATUS.detail)
def test_the_table_has_every_depth_and_the_same_bits() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.benchmarks.attention_bench", "--depths", "0,40",
         "--chunk", "24", "--repeats", "1"], capture_output=True, text=True, timeout=300,
        check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 5][1:]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 24), (0, 1), (40, 24), (40, 1)]
    assert all(r[5].strip() == "yes" for r in rows), out
    assert "CPU: " in out
