"""LoRA benchmark: one engine, a batch of requests of 8 adapters against the same batch on the
base model alone, side by side in one run; and an adapter's cold load.

    python -m cluster.benchmarks.lora_bench [--requests 32] [--prompt-tokens 64]
        [--output-tokens 64] [--adapters 8] [--rank 16]
        [--repeats 3]

The adapters are random (``write_random_adapter``: rank ``--rank`` on all seven projections of
every layer), made in a temporary directory. Each repeat runs the base batch, then the mixed
batch (the requests spread round-robin over the adapters), in one ``EngineCore`` with the
settings ``make up`` uses (the CPU kernels, bfloat16 where native, int4 for the default model),
all requests added at once; the figure is output tokens over the batch's wall time, and the
medians over the repeats are reported with their ratio. The cold load is the median of loading
each adapter from disk (``load_adapter``: read, check, convert).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from replicas.engine.config import EngineConfig, default_model_path
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.device_choice import cpu_flags
from replicas.torch_engine.engine_core import EngineCore
from replicas.torch_engine.loader import load_model_source
from replicas.torch_engine.lora import load_adapter, write_random_adapter


def _batch(engine: EngineCore, prompts: list[list[int]], adapters: list[str | None],
           output_tokens: int, tag: str) -> float:
    """Output tokens per second of the whole batch, all added at once."""
    started = time.perf_counter()
    for i, (ids, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        sampling = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        engine.add(engine.prepare(GenerateRequest(f"{tag}-{i}", sampling,
                                                  prompt_token_ids=tuple(ids),
                                                  adapter=adapter)))
    num_tokens = 0
    while engine.has_unfinished:
        num_tokens += sum(len(chunk.token_ids) for chunk in engine.step())
    return num_tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    source = load_model_source(default_model_path())
    with tempfile.TemporaryDirectory(prefix="fairserve-lora-bench-") as directory:
        paths = {f"adapter-{i}": write_random_adapter(Path(directory) / f"a{i}", source.config,
                                                      args.rank, seed=i)
                 for i in range(args.adapters)}
        loads = [load_adapter(path, source.config, name).load_s for name, path in paths.items()]
        engine = EngineCore(EngineConfig(num_threads=args.threads, max_num_seqs=args.requests,
                                         max_loras=args.adapters,
                                         lora_adapters={n: str(p) for n, p in paths.items()}),
                            source=source)
        words = source.tokenizer.encode(" ".join(["river mountain quiet engine garden"] * 200))
        prompts = [words[i:i + args.prompt_tokens] for i in range(args.requests)]
        names = list(paths)
        mixed: list[str | None] = [names[i % len(names)] for i in range(args.requests)]
        _batch(engine, prompts[:2], [None, names[0]], 4, "warm")  # kernels, first adapter
        base_runs, lora_runs = [], []
        for repeat in range(args.repeats):
            base_runs.append(_batch(engine, prompts, [None] * args.requests,
                                    args.output_tokens, f"base{repeat}"))
            lora_runs.append(_batch(engine, prompts, mixed, args.output_tokens, f"lora{repeat}"))
    base, lora = statistics.median(base_runs), statistics.median(lora_runs)
    flags = cpu_flags()
    cpu = "AMX" if "amx_bf16" in flags else "AVX-512 bf16" if "avx512_bf16" in flags else "AVX2"
    print(f"engine: {engine.compute.describe()}; CPU with {cpu}; {args.requests} requests of "
          f"{args.prompt_tokens} -> {args.output_tokens} tokens, {args.repeats} repeats")
    print(f"{'batch':<34}{'output tok/s (median)':>24}{'runs':>30}")
    print(f"{'base model alone':<34}{base:>24.1f}{'  '.join(f'{r:.1f}' for r in base_runs):>30}")
    print(f"{f'{args.adapters} adapters (rank {args.rank}), mixed':<34}{lora:>24.1f}"
          f"{'  '.join(f'{r:.1f}' for r in lora_runs):>30}")
    print(f"ratio (adapters / base): {lora / base:.3f} ({(1 - lora / base) * 100:.1f} % slower)")
    print(f"cold load of an adapter (rank {args.rank}, 7 projections x "
          f"{source.config.num_layers} layers): median {statistics.median(loads) * 1000:.0f} ms "
          f"(of {len(loads)})")


if __name__ == "__main__":
    main()
