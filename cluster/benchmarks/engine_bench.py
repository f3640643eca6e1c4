"""Engine benchmark: this engine against a transformers baseline, in one process and one run.

    python -m cluster.benchmarks.engine_bench [--requests 32] [--prompt-tokens 100]
        [--output-tokens 64] [--concurrency 1 8 32] [--repeats 1]

Workload: distinct prompts of exactly ``--prompt-tokens`` tokens (no shared prefixes, so the
prefix cache gives the engine no help), each generating exactly ``--output-tokens`` tokens
(EOS ignored). At concurrency c, c requests are in flight at a time:
- engine: a closed loop through the async ``TorchEngine``; a new request starts as soon as one
  finishes (continuous batching);
- baseline: transformers ``generate`` (greedy, KV cache, SDPA attention) on batches of c
  requests one after another (static batching), the best transformers offers out of the box.
TTFT is measured from a request's start (its slot freeing up) to its first token; the decode
step is the median time between a request's consecutive tokens. Runs alternate engine and
baseline per concurrency; with ``--repeats`` > 1 the medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import torch

from replicas.engine.config import EngineConfig
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.async_engine import TorchEngine
from replicas.torch_engine.loader import load_model_source

WORDS = ["river", "mountain", "quiet", "engine", "garden", "silver", "market", "window", "history", "science", "music", "winter", "harbor", "letter", "planet", "forest", "copper", "lantern", "bridge", "morning", "theory", "island", "violet", "school", "signal", "pocket", "thunder", "canvas", "meadow", "orbit", "castle", "shadow", "ladder", "breeze", "marble", "rocket"]


@dataclass(frozen=True, slots=True)
class Result:
    system: str
    concurrency: int
    wall_s: float
    num_output_tokens: int
    ttft_s: list[float]
    step_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def make_prompts(tokenizer, n: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < num_tokens:
            ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(num_tokens * 2)))
        prompts.append(ids[:num_tokens])
    return prompts


async def run_engine(engine: TorchEngine, prompts: list[list[int]], concurrency: int, num_out: int,
                     sampling: dict | None = None) -> Result:
    """``sampling``: SamplingParams fields (default: greedy)."""
    slots = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    steps: list[float] = []

    async def one(i: int, ids: list[int]) -> int:
        async with slots:
            start = time.perf_counter()
            params = SamplingParams(max_tokens=num_out, ignore_eos=True,
                                    **(sampling or {"temperature": 0.0}))
            stamps = []
            async for chunk in engine.generate(GenerateRequest(f"bench-{concurrency}-{i}", params, prompt_token_ids=tuple(ids))):
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
            ttft.append(stamps[0] - start)
            steps.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))
            return len(stamps)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return Result("engine", concurrency, wall, sum(counts), ttft, steps)


class _StepClock:
    """A transformers StoppingCriteria that only records when each token was generated."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_baseline(model, prompts: list[list[int]], concurrency: int, num_out: int, pad_id: int) -> Result:
    from transformers import StoppingCriteriaList

    ttft: list[float] = []
    steps: list[float] = []
    total = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start : start + concurrency]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = _StepClock()
        began = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=num_out, min_new_tokens=num_out,
                do_sample=False, pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]),
            )
        total += (out.shape[1] - width) * len(batch)
        ttft.extend([clock.stamps[0] - began] * len(batch))
        steps.extend(b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False))
    wall = time.perf_counter() - t0
    return Result("transformers", concurrency, wall, total, ttft, steps)


def load_baseline(model_path: str):
    """transformers' own GGUF loading of the same file (dequantised to float32)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


def _median_result(results: list[Result]) -> Result:
    best = sorted(results, key=lambda r: r.tokens_per_s)[len(results) // 2]
    return best


def print_table(pairs: list[tuple[Result, Result]]) -> None:
    header = f"{'concurrency':>11} | {'system':<12} | {'out tok/s':>9} | {'TTFT p50 ms':>11} | {'decode step p50 ms':>18} | {'speedup':>7}"
    print(header)
    print("-" * len(header))
    for engine, base in pairs:
        for r in (base, engine):
            speedup = f"{engine.tokens_per_s / base.tokens_per_s:.2f}x" if r is engine else ""
            print(
                f"{r.concurrency:>11} | {r.system:<12} | {r.tokens_per_s:>9.1f} | "
                f"{statistics.median(r.ttft_s) * 1e3:>11.0f} | "
                f"{statistics.median(r.step_s) * 1e3:>18.1f} | {speedup:>7}"
            )


async def main_async(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(args.concurrency),
        num_threads=args.threads,
    )
    source = load_model_source(config.model)
    prompts = make_prompts(source.tokenizer, args.requests, args.prompt_tokens)
    engine = TorchEngine(config)
    t = time.perf_counter()
    await engine.start()
    print(f"engine loaded in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    baseline = load_baseline(config.model)
    print(f"transformers baseline loaded in {time.perf_counter() - t:.1f} s")
    pad_id = source.tokenizer.eos_token_ids[0]
    # warm both up once (allocator, thread pools)
    await run_engine(engine, prompts[:2], 2, 4)
    run_baseline(baseline, prompts[:2], 2, 4, pad_id)
    pairs = []
    for c in args.concurrency:
        runs_e, runs_b = [], []
        for _ in range(args.repeats):
            runs_b.append(run_baseline(baseline, prompts, c, args.output_tokens, pad_id))
            runs_e.append(await run_engine(engine, prompts, c, args.output_tokens))
        pairs.append((_median_result(runs_e), _median_result(runs_b)))
        print(f"concurrency {c}: engine {pairs[-1][0].tokens_per_s:.1f} tok/s, transformers {pairs[-1][1].tokens_per_s:.1f} tok/s", flush=True)
    await engine.shutdown()
    print()
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens -> {args.output_tokens} output tokens, "
          f"{args.threads} torch threads, float32, torch {torch.__version__}")
    print_table(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
