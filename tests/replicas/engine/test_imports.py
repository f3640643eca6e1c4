"""The engine contract loads no implementation: ``import replicas.engine`` (its protocol,
config, errors, sampling parameters and factory) brings in neither torch nor an engine, so the
CLI and the settings can use it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helm.chart import REPO


def test_importing_the_contract_loads_no_torch_and_no_engine() -> None:
    code = ("import json, sys; import replicas.engine; "
            "from replicas.engine import factory, resume_rules, tokenizer, lora_files; "
            "print(json.dumps(sorted(m for m in sys.modules if m in ('torch', 'vllm') "
            "or m.startswith(('torch.', 'vllm.', 'replicas.torch_engine', "
            "'replicas.vllm_engine', 'transformers')))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
