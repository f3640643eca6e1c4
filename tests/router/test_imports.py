"""A router process loads neither torch nor the engine: what it shares with the replicas comes
from ``replicas.protocol`` alone (torch costs a router seconds of start-up and some 300 MB)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helm.chart import REPO


def test_importing_the_router_loads_no_torch_and_no_engine() -> None:
    code = ("import json, sys; import router.server; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' "
            "or m.startswith(('torch.', 'replicas.engine', 'replicas.torch_engine', "
            "'replicas.vllm_engine', 'transformers')))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
