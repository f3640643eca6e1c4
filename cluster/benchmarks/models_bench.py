"""Two models side by side: one tenant floods the default model; does the other model's
time to first token move? One cluster, as ``deploy/examples/models.yaml`` runs it (the default
model and a second deployment of the same weights, one replica each), in one run.

    python -m cluster.benchmarks.models_bench [--quiet-requests 30] [--noisy-streams 32]
        [--quiet-prompt-tokens 100] [--quiet-output-tokens 16] [--noisy-prompt-tokens 100]
        [--noisy-output-tokens 64] [--warmup-s 5]

- solo: the quiet tenant sends ``--quiet-requests`` requests to the second model, one after
  the other, then as many to the default model;
- flood: the noisy tenant keeps ``--noisy-streams`` streams open on the default model (each
  ends and is replaced at once; more than its replica takes, so its queue holds a backlog);
  after ``--warmup-s`` the quiet tenant sends the same requests again, to the second model,
  then to the flooded one.

The flood waits in the default model's queue in Redis and is granted against the default
model's replicas only, so the second model's requests never wait behind it: what is left is
the two replicas sharing this machine's CPUs. The quiet tenant on the flooded model itself is
the contrast (it gets a fair share there, but waits for a slot). Prompts are distinct token ids,
greedy, exactly the output tokens asked (``ignore_eos``), streamed over HTTP; the table gives
TTFT p50 and p90 solo and under the flood, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cluster.benchmarks.engine_bench import make_prompts
from cluster.benchmarks.fairness_bench import Client, stop_floods, ttft_cells, ttft_header
from cluster.benchmarks.peer_bench import cpu_name
from cluster.benchmarks.sse import percentile
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from replicas.engine.config import EngineConfig
from replicas.torch_engine.loader import load_model_source
from router.state.tenants import Tenant

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "models.yaml"


@dataclass(slots=True)
class Row:
    label: str
    model: str
    solo_ttft_s: list[float] = field(default_factory=list)
    flood_ttft_s: list[float] = field(default_factory=list)


async def _flood_phase(args: argparse.Namespace, http: httpx.AsyncClient, base: str,
                       noisy: str, default_model: str, prompts: object, during: object
                       ) -> float:
    """The noisy streams on the default model while ``during()`` runs; returns the noisy
    tenant's output tokens per second over that time."""
    client = Client(http, base, default_model)
    stopping = asyncio.Event()
    marks: list[tuple[float, int]] = []

    async def noisy_stream() -> None:
        while not stopping.is_set():
            (ids,) = prompts(1, args.noisy_prompt_tokens)  # type: ignore[operator]
            await client.stream(noisy, ids, args.noisy_output_tokens,
                                lambda n, at: marks.append((at, n)))

    floods = [asyncio.create_task(noisy_stream()) for _ in range(args.noisy_streams)]
    try:
        await asyncio.sleep(args.warmup_s)
        start = time.perf_counter()
        await during()  # type: ignore[operator]
        end = time.perf_counter()
    finally:
        await stop_floods(floods, stopping)
    return sum(n for at, n in marks if start <= at <= end) / (end - start)


async def measure(args: argparse.Namespace, base: str, quiet: str, noisy: str,
                  rows: list[Row], default_model: str) -> float:
    tokenizer = load_model_source(EngineConfig().model).tokenizer
    seed = iter(range(1, 1_000_000))

    def prompts(n: int, length: int) -> list[list[int]]:
        return make_prompts(tokenizer, n, length, seed=next(seed))

    async with httpx.AsyncClient(timeout=900) as http:
        async def quiet_round(phase: str) -> None:
            for row in rows:
                client = Client(http, base, row.model)
                for ids in prompts(args.quiet_requests, args.quiet_prompt_tokens):
                    ttft = await client.stream(quiet, ids, args.quiet_output_tokens)
                    (row.solo_ttft_s if phase == "solo" else row.flood_ttft_s).append(ttft)
                print(f"{phase} {row.label}: TTFT p50 "
                      f"{percentile(getattr(row, phase + '_ttft_s'), 50) * 1e3:.0f} ms",
                      flush=True)

        for row in rows:  # warm-up: each model's first requests
            for ids in prompts(2, args.quiet_prompt_tokens):
                await Client(http, base, row.model).stream(quiet, ids, 4)
        await quiet_round("solo")
        return await _flood_phase(args, http, base, noisy, default_model, prompts,
                                  lambda: quiet_round("flood"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quiet-requests", type=int, default=30)
    parser.add_argument("--noisy-streams", type=int, default=32)
    parser.add_argument("--quiet-prompt-tokens", type=int, default=100)
    parser.add_argument("--quiet-output-tokens", type=int, default=16)
    parser.add_argument("--noisy-prompt-tokens", type=int, default=100)
    parser.add_argument("--noisy-output-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fairserve-models-bench-") as state_dir:
        settings = load_settings(EXAMPLE, state_dir=state_dir, router={"port": free_port()},
                                 redis={"port": free_port()}, tenants={"create_demo": False},
                                 # the flood must queue: fewer slots than its streams
                                 replicas={"num_replicas": 1,
                                           "max_ongoing_requests": args.noisy_streams // 2})
        default, second = settings.served_models()
        rows = [Row(f"second model ({second.name})", second.name),
                Row(f"flooded model ({default.name})", default.name)]
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            quiet = add_tenant_with_key(info.redis_url, Tenant(id="quiet"))
            noisy = add_tenant_with_key(info.redis_url, Tenant(id="noisy", max_queued=10_000))
            noisy_tps = asyncio.run(measure(args, info.base_url, quiet, noisy, rows,
                                            default.name))
        finally:
            cluster.stop()
    print()
    print(f"{cpu_name()}; {EXAMPLE.name}: one replica per model, the default model's "
          f"taking {args.noisy_streams // 2} at once; quiet: {args.quiet_requests} requests one "
          f"at a time per model, {args.quiet_prompt_tokens} -> {args.quiet_output_tokens} tokens; "
          f"noisy: {args.noisy_streams} streams on the default model, "
          f"{args.noisy_prompt_tokens} -> {args.noisy_output_tokens} tokens ({noisy_tps:.1f} "
          "tok/s during the quiet requests); p90 nearest rank")
    header = f"{'quiet requests to':<44} | {ttft_header(90)}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.label:<44} | {ttft_cells(r.solo_ttft_s, r.flood_ttft_s, 90)}")


if __name__ == "__main__":
    main()
