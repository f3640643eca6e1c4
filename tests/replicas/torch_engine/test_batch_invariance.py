"""bfloat16 on a CPU with native bf16: a request's tokens do not depend on the requests decoded
beside it (the row tiles of replicas/torch_engine/models/cpu_linear.py). Without them 12 of 16
greedy texts differed between a run alone and a run together on a 2-core Xeon with AMX."""

from __future__ import annotations

import asyncio

import pytest

from replicas.engine.config import DType, EngineConfig
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.async_engine import TorchEngine
from replicas.torch_engine.device_choice import CPU_BF16_FLAGS, cpu_flags

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CPU_BF16_FLAGS & cpu_flags(),
                       reason="this CPU has no native bfloat16 (avx512_bf16, amx_bf16)"),
]

TOPICS = ("a lighthouse", "a baker", "a robot", "a sailor", "a wizard", "a pilot")


def _request(i: int, topic: str, seed: int | None) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if seed is None
                              else 0.8, seed=seed)
    messages = ({"role": "user", "content": f"Write a short story about {topic}."},)
    return GenerateRequest(f"inv-{i}-{seed}", sampling, messages=messages)


async def _tokens(engine: TorchEngine, request: GenerateRequest) -> list[int]:
    return [t async for chunk in engine.generate(request) for t in chunk.token_ids]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_bfloat16_tokens_are_the_same_alone_and_together(seeded: bool) -> None:
    async def run() -> tuple[list[list[int]], list[list[int]]]:
        engine = TorchEngine(EngineConfig(dtype=DType.BFLOAT16, num_threads=2))
        await engine.start()
        try:
            requests = [_request(i, t, i if seeded else None) for i, t in enumerate(TOPICS)]
            alone = [await _tokens(engine, r) for r in requests]
            together = await asyncio.gather(*(_tokens(engine, r) for r in requests))
            return alone, list(together)
        finally:
            await engine.shutdown()

    alone, together = asyncio.run(run())
    assert all(len(tokens) == 24 for tokens in alone)
    assert together == alone
