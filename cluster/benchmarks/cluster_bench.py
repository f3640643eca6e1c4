"""Cluster benchmark: the same workload directly against the engine and through the cluster's
HTTP API (one replica), in one run.

    python -m cluster.benchmarks.cluster_bench [--requests 32] [--prompt-tokens 100] [--output-tokens 64]
                            [--concurrency 1 32] [--repeats 3] [--threads 2]

Workload (as ``cluster.benchmarks.engine_bench``): distinct prompts of exactly
``--prompt-tokens`` tokens, each generating exactly ``--output-tokens`` tokens, greedy; at concurrency c, c requests in
flight at a time (a closed loop). Direct: the async ``TorchEngine`` in this process. Cluster:
``fairserve``'s own launcher (embedded Redis, local Ray, one replica with the same engine
settings, one router), driven over HTTP with the ``openai`` SDK, streaming; prompts are sent as
token ids (``/v1/completions``) and the output length is pinned with ``min_tokens``. TTFT is
from a request's start to its first token (through the cluster: the first SSE chunk, which
carries it; its text may be empty while a character is incomplete). Runs
alternate direct and cluster, with fresh prompts each run (no prefix-cache help); the table
shows the median run of each.

Beside them, the latency floor of the cluster's shape (``cluster/benchmarks/serve_floor.py``): the same two
Ray Serve hops with no work at either end, so the added TTFT splits into what Ray Serve costs on
this machine and what fairserve adds on top.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai

from cluster.benchmarks import serve_floor
from cluster.benchmarks.engine_bench import make_prompts, run_engine
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import FairserveSettings, load_settings
from replicas.engine.config import EngineConfig
from replicas.torch_engine.async_engine import TorchEngine
from replicas.torch_engine.loader import load_model_source
from router.state.tenants import Tenant


@dataclass(frozen=True, slots=True)
class Run:
    system: str
    concurrency: int
    wall_s: float
    num_output_tokens: int
    ttft_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def ttft_ms(self, q: float) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3


async def run_cluster(client: openai.AsyncOpenAI, model: str, prompts: list[list[int]],
                      concurrency: int, num_out: int,
                      headers: Callable[[], dict[str, str]] | None = None,
                      system: str = "cluster") -> Run:
    """The workload through the HTTP API; ``headers`` makes each request's extra headers."""
    slots = asyncio.Semaphore(concurrency)
    ttft: list[float] = []

    async def one(ids: list[int]) -> int:
        async with slots:
            start = time.perf_counter()
            first: float | None = None
            tokens = 0
            stream = await client.completions.create(
                model=model, prompt=ids, max_tokens=num_out, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"min_tokens": num_out},
                extra_headers=headers() if headers else None)
            async for chunk in stream:
                if first is None and chunk.choices:  # every completions chunk carries tokens
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            ttft.append((first or time.perf_counter()) - start)
            return tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return Run(system, concurrency, time.perf_counter() - t0, sum(counts), ttft)


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def print_table(pairs: list[tuple[Run, Run]]) -> None:
    header = (f"{'concurrency':>11} | {'system':<8} | {'out tok/s':>9} | {'vs direct':>9} | "
              f"{'TTFT p50 ms':>11} | {'TTFT p99 ms':>11} | {'added TTFT p50 ms':>17}")
    print(header)
    print("-" * len(header))
    for direct, cluster in pairs:
        for r in (direct, cluster):
            is_cluster = r is cluster
            ratio = f"{cluster.tokens_per_s / direct.tokens_per_s:.1%}" if is_cluster else ""
            added = f"{cluster.ttft_ms(0.5) - direct.ttft_ms(0.5):+.1f}" if is_cluster else ""
            print(f"{r.concurrency:>11} | {r.system:<8} | {r.tokens_per_s:>9.1f} | {ratio:>9} | "
                  f"{r.ttft_ms(0.5):>11.1f} | {r.ttft_ms(0.99):>11.1f} | {added:>17}")


def print_floor(floor_s: list[float]) -> None:
    ordered = sorted(floor_s)
    print(f"\nRay Serve floor (proxy -> ingress -> streaming handle -> first event, no work at "
          f"either end, {len(ordered)} requests one at a time): first event p50 "
          f"{ordered[len(ordered) // 2] * 1e3:.1f} ms, min {ordered[0] * 1e3:.1f} ms")


async def measure(args: argparse.Namespace, base_url: str, key: str, model: str
                  ) -> tuple[list[tuple[Run, Run]], list[float]]:
    config = EngineConfig(num_threads=args.threads, max_num_seqs=max(args.concurrency))
    tokenizer = load_model_source(config.model).tokenizer
    engine = TorchEngine(config)
    await engine.start()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    seed = 1
    try:
        warm = make_prompts(tokenizer, 2, args.prompt_tokens, seed=0)
        await run_engine(engine, warm, 2, 4)
        await run_cluster(client, model, warm, 2, 4)
        pairs, floor_s = [], []
        http_root = base_url.removesuffix("/v1")
        async with httpx.AsyncClient(timeout=60) as http:
            await serve_floor.first_event_s(http, http_root, 2)  # warm-up
            for _ in range(args.repeats):
                floor_s += await serve_floor.first_event_s(http, http_root, args.requests)
        for c in args.concurrency:
            direct_runs, cluster_runs = [], []
            for _ in range(args.repeats):
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens, seed=seed)
                seed += 1
                e = await run_engine(engine, prompts, c, args.output_tokens)
                direct_runs.append(Run("direct", c, e.wall_s, e.num_output_tokens, e.ttft_s))
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens, seed=seed)
                seed += 1
                cluster_runs.append(await run_cluster(client, model, prompts, c,
                                                      args.output_tokens))
                print(f"concurrency {c}: direct {direct_runs[-1].tokens_per_s:.1f} tok/s, "
                      f"cluster {cluster_runs[-1].tokens_per_s:.1f} tok/s", flush=True)
            pairs.append((median_run(direct_runs), median_run(cluster_runs)))
        return pairs, floor_s
    finally:
        await client.close()
        await engine.shutdown()


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload of the cluster benchmarks (this one and ``cluster.benchmarks.trace_bench``)."""
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)


def bench_settings(state_dir: str, threads: int, slots: int) -> FairserveSettings:
    """One replica with ``slots`` slots and one router on a local Ray of 2 CPUs."""
    return load_settings(
        state_dir=state_dir,
        engine={"num_threads": threads, "max_num_seqs": slots},
        replicas={"num_replicas": 1, "num_cpus": 1, "max_ongoing_requests": slots},
        router={"num_replicas": 1, "num_cpus": 0.25, "port": free_port()},
        redis={"port": free_port()}, ray={"num_cpus": 2},
        tenants={"create_demo": False},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser)
    args = parser.parse_args()
    slots = max(args.concurrency)
    with tempfile.TemporaryDirectory(prefix="fairserve-bench-") as state_dir:
        settings = bench_settings(state_dir, args.threads, slots)
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="bench", max_queued=10_000))
            serve_floor.deploy()
            pairs, floor_s = asyncio.run(measure(args, info.base_url, key,
                                        settings.engine.served_model_name))
        finally:
            cluster.stop()
    print()
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens -> "
          f"{args.output_tokens} output tokens, {args.threads} torch threads, median of "
          f"{args.repeats} runs; cluster = HTTP (openai SDK, streaming) -> Ray Serve proxy -> "
          "router -> Redis queue -> dispatcher -> 1 replica")
    print_table(pairs)
    print_floor(floor_s)


if __name__ == "__main__":
    main()
