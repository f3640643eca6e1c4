"""What the sampler's logit processing costs: at 32 requests, with the features off and on.

    python -m cluster.benchmarks.sampler_bench [--requests 32] [--prompt-tokens 100]
        [--output-tokens 64] [--repeats 3]

Two measurements, in one run:
1. The whole engine, closed loop at concurrency ``--requests`` (the engine benchmark's
   workload, ``cluster/benchmarks/engine_bench.py``): features off (greedy, nothing else), and
   on (every request with ``logit_bias``, the three penalties and ``min_p``, sampling at temperature 1),
   alternating, median of ``--repeats``. Reports tokens/s and the median decode step.
2. The sampler alone on a step's real shape (32 rows of the model's vocabulary, float32), in
   the engine's process: ``Sampler.sample`` as it is, against the same call with the logit
   processing hook (``sampler._process``) replaced by the identity. With the features off the
   difference is all the new work costs a step; it is reported as a share of the median engine
   decode step from (1). The target: under 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import torch

from cluster.benchmarks.engine_bench import Result, make_prompts, run_engine
from replicas.engine.config import EngineConfig
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine import sampler as sampler_module
from replicas.torch_engine.async_engine import TorchEngine
from replicas.torch_engine.loader import load_model_source
from replicas.torch_engine.sampler import Sampler
from replicas.torch_engine.sequence import Sequence

FEATURES_ON = {"temperature": 1.0, "seed": 1, "logit_bias": ((13, 2.0), (42, -5.0)),
               "repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2,
               "min_p": 0.05}
FEATURES_OFF = {"temperature": 0.0}
MICRO_ROUNDS = 200


def _sequences(prompts: list[list[int]], features: dict, num_output: int) -> list[Sequence]:
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence.from_prompt(f"s{i}", ids, SamplingParams(max_tokens=1000, **features))
        for t in range(num_output):
            seq.append_token((ids[t % len(ids)] + t) % 1000)
        seqs.append(seq)
    return seqs


def time_sampler(vocab: int, seqs: list[Sequence]) -> tuple[float, float]:
    """Median seconds of one ``Sampler.sample`` over ``seqs`` (random logits of the step's
    shape): as it is, and with the logit processing hook bypassed; the two interleaved."""
    sampler = Sampler((0,), torch.device("cpu"))
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(0))
    real = sampler_module._process
    whole: list[float] = []
    bypassed: list[float] = []
    try:
        for _ in range(MICRO_ROUNDS):
            for times, hook in ((whole, real), (bypassed, _identity)):
                sampler_module._process = hook  # type: ignore[assignment]
                start = time.perf_counter()
                sampler.sample(logits, seqs)
                times.append(time.perf_counter() - start)
    finally:
        sampler_module._process = real
    return statistics.median(whole), statistics.median(bypassed)


def _identity(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return logits


async def engine_runs(args: argparse.Namespace, prompts: list[list[int]]
                      ) -> dict[str, list[Result]]:
    config = EngineConfig(max_num_seqs=args.requests, num_threads=args.threads)
    engine = TorchEngine(config)
    await engine.start()
    runs: dict[str, list[Result]] = {"off": [], "on": []}
    try:
        await run_engine(engine, prompts[:2], 2, 4)  # warm up
        for _ in range(args.repeats):
            for name, features in (("off", FEATURES_OFF), ("on", FEATURES_ON)):
                runs[name].append(await run_engine(engine, prompts, args.requests,
                                                   args.output_tokens, features))
    finally:
        await engine.shutdown()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = load_model_source(EngineConfig().model)
    prompts = make_prompts(source.tokenizer, args.requests, args.prompt_tokens)
    runs = asyncio.run(engine_runs(args, prompts))
    vocab = source.config.vocab_size
    micro = {name: time_sampler(vocab, _sequences(prompts, features, args.output_tokens))
             for name, features in (("off", FEATURES_OFF), ("on", FEATURES_ON))}
    cpu = platform.processor() or platform.machine()
    print(f"\n{args.requests} requests x {args.prompt_tokens} prompt -> {args.output_tokens} "
          f"output tokens, {args.threads} torch threads, float32, torch {torch.__version__}, "
          f"CPU {_cpu_name() or cpu}, median of {args.repeats}")
    print(f"{'features':>8} | {'out tok/s':>9} | {'decode step p50 ms':>18} | "
          f"{'sampler ms':>10} | {'logit processing ms':>19} | {'share of step':>13}")
    step_off = 0.0
    for name in ("off", "on"):
        tokens_per_s = statistics.median(r.tokens_per_s for r in runs[name])
        step = statistics.median(statistics.median(r.step_s) for r in runs[name])
        step_off = step if name == "off" else step_off
        whole, bypassed = micro[name]
        extra = max(0.0, whole - bypassed)
        print(f"{name:>8} | {tokens_per_s:>9.1f} | {step * 1e3:>18.1f} | {whole * 1e3:>10.3f} | "
              f"{extra * 1e3:>19.3f} | {extra / step:>12.3%}")
    on = statistics.median(r.tokens_per_s for r in runs["on"])
    off = statistics.median(r.tokens_per_s for r in runs["off"])
    print(f"features on / off throughput: {on / off:.3f}; new work with the features off: "
          f"{max(0.0, micro['off'][0] - micro['off'][1]) / step_off:.3%} of a step "
          "(target < 5%)")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
