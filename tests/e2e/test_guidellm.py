"""guidellm (the vLLM project's load tool, pinned in the dev extra) against the cluster, as users
run it: synthetic data, a concurrent profile, streaming chat. It sends vLLM's extensions
(``ignore_eos``, ``stream_options.continuous_usage_stats``) with every request; every request
must succeed and report exactly the output tokens it asked for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS, STREAMS = 24, 64, 16, 4


def guidellm_command(e2e: E2ECluster, tokenizer_dir: Path, report: Path,
                     request_format: str) -> list[str]:
    guidellm = shutil.which("guidellm", path=str(Path(sys.executable).parent))
    assert guidellm is not None, "guidellm is in the dev extra"
    # every option in its JSON form: key=value values are parsed as YAML (keys, names)
    return [
        guidellm, "run",
        "--backend", json.dumps({"kind": "openai_http", "target": e2e.base_url,
                                 "api_key": e2e.demo_key, "model": MODEL,
                                 "request_format": request_format, "stream": True,
                                 "timeout": 120}),
        "--profile", json.dumps({"kind": "concurrent", "streams": STREAMS}),
        "--constraint", json.dumps({"kind": "max_requests", "count": NUM_REQUESTS}),
        "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS,
                              "output_tokens": OUTPUT_TOKENS}),
        "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(tokenizer_dir)}),
        "--output", json.dumps({"kind": "json", "path": str(report)}),
        "--disable-console",
    ]


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_synthetic_concurrent_run_gets_every_token_it_asked_for(
        e2e: E2ECluster, tmp_path: Path, request_format: str) -> None:
    tokenizer_dir = tmp_path / "tokenizer"  # the model's own tokenizer, no hub download
    tokenizer_dir.mkdir()
    for name, content in e2e.model_info.tokenizer_files.items():
        (tokenizer_dir / name).write_bytes(content)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM__")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(guidellm_command(e2e, tokenizer_dir, report, request_format),
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    requests = benchmark["requests"]
    # guidellm exits 0 even when requests fail: count them
    assert not requests["errored"] and not requests["incomplete"], (
        [r["info"]["error"] for r in requests["errored"] or []])
    successful = requests["successful"]
    # guidellm 0.8.1 can close its run with the last request still counted as processing (its
    # scheduler state: processed 23, processing 1, nothing errored): that one is not ours to judge
    in_flight = benchmark["scheduler_state"]["processing_requests"]
    assert in_flight <= 1 and len(successful) + in_flight == NUM_REQUESTS, (
        len(successful), in_flight)
    for record in successful:
        # from the server's usage: ignore_eos honoured, exactly the tokens asked for
        assert record["output_tokens"] == OUTPUT_TOKENS, record
        assert record["prompt_tokens"] >= PROMPT_TOKENS, record
        assert json.loads(record["request_args"])["body"]["ignore_eos"] is True
