"""The torch engine on a CUDA GPU: same greedy text as on CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.engine_core import EngineCore

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_engine_answers_like_the_cpu_engine(dtype: str) -> None:
    core = EngineCore(EngineConfig(device="cuda", dtype=dtype, max_num_seqs=8))
    request = GenerateRequest(
        "gpu",
        SamplingParams(max_tokens=20, temperature=0.0),
        messages=({"role": "user", "content": "Which city is the capital of France?"},),
    )
    core.add(core.prepare(request))
    chunks = []
    while core.has_unfinished:
        chunks.extend(core.step())
    assert "Paris" in "".join(c.text for c in chunks)
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
