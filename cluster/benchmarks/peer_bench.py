"""CPU benchmark against the peer: llama.cpp's ``llama-server``, fairserve's engine alone, and
fairserve's cluster as ``make up`` runs it, on the same GGUF file, in one run.

    python -m cluster.benchmarks.peer_bench [--concurrency 1 32] [--requests 32]
        [--prompt-tokens 100] [--output-tokens 64] [--repeats 3] [--threads 2] [--no-peer]
        [--dtype auto|float32|bfloat16] [--ray-quiet on|off|both]

Workload: distinct prompts of exactly ``--prompt-tokens`` tokens (sent as token ids, so every
system sees the same tokens), each generating exactly ``--output-tokens`` tokens (``ignore_eos``),
greedy, streamed; at concurrency c, c requests in flight at a time (a closed loop of
``max(c, --requests)`` requests; 4 at concurrency 1). Per run: output tokens per second of wall time, TTFT (request
start to first token) and TPOT (time per output token after the first: (last - first) / (n - 1),
per request). Runs alternate the systems, fresh prompts each run; the table shows each system's
median run and the ratios to llama.cpp. llama-server runs with ``-t/-tb --threads`` and
``--parallel max(concurrency)``; the engine alone with ``num_threads --threads``; the cluster
with the settings ``make up`` uses (only its ports moved), through HTTP, Ray Serve, the router,
Redis and one replica. ``--ray-quiet both`` runs it all twice, a cluster with Ray's defaults
first and then one with ``ray.quiet`` (``cluster/ray_quiet.py``), each pass with the engine
alone beside it, and prints a table for each.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import torch

from cluster.benchmarks import llamacpp
from cluster.benchmarks.engine_bench import make_prompts
from cluster.benchmarks.sse import sse_events
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from replicas.engine.config import EngineConfig
from replicas.engine.interface import GenerateRequest
from replicas.engine.sampling_params import SamplingParams
from replicas.torch_engine.async_engine import TorchEngine
from replicas.torch_engine.loader import load_model_source
from router.state.tenants import Tenant


@dataclass(slots=True)
class Run:
    system: str
    concurrency: int
    wall_s: float = 0.0
    num_output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s else 0.0

    def record(self, start: float, first: float, last: float, num_tokens: int) -> None:
        """One request: its start, the instants of its first and last output tokens."""
        self.num_output_tokens += num_tokens
        self.ttft_s.append(first - start)
        if num_tokens > 1:
            self.tpot_s.append((last - first) / (num_tokens - 1))


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


async def run_http(http: httpx.AsyncClient, url: str, headers: dict[str, str], system: str,
                   prompts: list[list[int]], concurrency: int, num_out: int,
                   model: str) -> Run:
    """The workload over an OpenAI-compatible ``/v1/completions`` with SSE."""
    run = Run(system, concurrency)
    slots = asyncio.Semaphore(concurrency)
    body = {"model": model, "max_tokens": num_out, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def one(ids: list[int]) -> None:
        async with slots:
            start = time.perf_counter()
            first = last = 0.0
            finish = None
            async for event in sse_events(http, url, {**body, "prompt": ids}, headers,
                                          label=f"{system}: "):
                for choice in event.get("choices") or ():
                    last = time.perf_counter()
                    first = first or last
                    finish = choice.get("finish_reason") or finish
            # with ignore_eos every request generates exactly num_out tokens: check it ended so
            if finish != "length":
                raise RuntimeError(f"{system}: a request ended with {finish!r}, not 'length'")
            run.record(start, first, last, num_out)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    run.wall_s = time.perf_counter() - t0
    return run


async def run_engine(engine: TorchEngine, prompts: list[list[int]], concurrency: int,
                     num_out: int) -> Run:
    run = Run("engine", concurrency)
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> None:
        async with slots:
            start = time.perf_counter()
            first = last = 0.0
            num_tokens = 0
            params = SamplingParams(max_tokens=num_out, ignore_eos=True, temperature=0.0)
            request = GenerateRequest(f"peer-{concurrency}-{i}-{start}", params,
                                      prompt_token_ids=tuple(ids))
            async for chunk in engine.generate(request):
                if chunk.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    num_tokens += len(chunk.token_ids)
            run.record(start, first, last, num_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    run.wall_s = time.perf_counter() - t0
    return run


@dataclass(slots=True)
class Systems:
    """What one round runs: each entry a name and a coroutine factory for a workload."""

    http: httpx.AsyncClient
    engine: TorchEngine
    peer_url: str | None
    cluster_url: str
    cluster_key: str
    model: str

    async def run(self, system: str, prompts: list[list[int]], c: int, n: int) -> Run:
        if system == "engine":
            return await run_engine(self.engine, prompts, c, n)
        if system == "llama.cpp":
            assert self.peer_url is not None
            return await run_http(self.http, f"{self.peer_url}/v1/completions", {}, system,
                                  prompts, c, n, self.model)
        return await run_http(self.http, f"{self.cluster_url}/completions",
                              {"Authorization": f"Bearer {self.cluster_key}"}, system,
                              prompts, c, n, self.model)


async def measure(args: argparse.Namespace, systems: Systems, names: list[str]
                  ) -> dict[int, dict[str, Run]]:
    tokenizer = load_model_source(EngineConfig().model).tokenizer
    seed = 1
    for name in names:  # warm-up: first calls, caches, thread pools
        await systems.run(name, make_prompts(tokenizer, 2, args.prompt_tokens, seed=0), 2, 4)
    medians: dict[int, dict[str, Run]] = {}
    for c in args.concurrency:
        runs: dict[str, list[Run]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                prompts = make_prompts(tokenizer, max(c, args.requests if c > 1 else 4),
                                       args.prompt_tokens, seed=seed)
                seed += 1
                run = await systems.run(name, prompts, c, args.output_tokens)
                runs[name].append(run)
                print(f"concurrency {c:>3} {name:<9} {run.tokens_per_s:7.1f} tok/s  TTFT p50 "
                      f"{_ms(run.ttft_s):7.1f} ms  TPOT p50 {_ms(run.tpot_s):6.1f} ms", flush=True)
        medians[c] = {name: sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2]
                      for name, rs in runs.items()}
    return medians


def print_table(medians: dict[int, dict[str, Run]], names: list[str]) -> None:
    base = "llama.cpp" if "llama.cpp" in names else None
    header = (f"{'streams':>7} | {'system':<9} | {'out tok/s':>9} | {'TTFT p50 ms':>11} | "
              f"{'TPOT p50 ms':>11} | {'tok/s vs llama.cpp':>18} | {'vs engine':>9}")
    print(header)
    print("-" * len(header))
    for c, by_name in medians.items():
        for name in names:
            r = by_name[name]
            vs_peer = (f"{r.tokens_per_s / by_name[base].tokens_per_s:.2f}x"
                       if base and name != base else "")
            vs_engine = (f"{r.tokens_per_s / by_name['engine'].tokens_per_s:.1%}"
                         if name == "cluster" else "")
            print(f"{c:>7} | {name:<9} | {r.tokens_per_s:>9.1f} | {_ms(r.ttft_s):>11.1f} | "
                  f"{_ms(r.tpot_s):>11.1f} | {vs_peer:>18} | {vs_engine:>9}")


def cpu_name() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    flags = set(lscpu.split())
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(features)}), torch {torch.__version__}"


async def _main(args: argparse.Namespace, peer: llamacpp.LlamaServer | None,
                cluster_url: str, key: str, model: str) -> dict[int, dict[str, Run]]:
    engine = TorchEngine(EngineConfig(num_threads=args.threads, dtype=args.dtype,
                                      max_num_seqs=max(64, max(args.concurrency))))
    await engine.start()
    names = (["llama.cpp"] if peer else []) + ["engine", "cluster"]
    try:
        # no keep-alive: llama-server closes idle connections after 5 s, while the others run
        no_keepalive = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=no_keepalive) as http:
            systems = Systems(http, engine, peer.base_url if peer else None, cluster_url, key,
                              model)
            return await measure(args, systems, names)
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="engine.dtype of the engine alone and of the cluster")
    parser.add_argument("--ray-quiet", default="on", choices=["on", "off", "both"],
                        help="the cluster's ray.quiet (both: a cluster with Ray's defaults, "
                        "then one with ray.quiet, each beside the engine alone)")
    args = parser.parse_args()
    gguf = EngineConfig().model
    peer = None
    if not args.no_peer:
        built = llamacpp.build()
        print(f"llama.cpp: {built.reason}", flush=True)
        if built.binary is not None:
            peer = llamacpp.LlamaServer(built.binary, gguf, free_port(), args.threads,
                                        max(args.concurrency),
                                        args.prompt_tokens + args.output_tokens + 64)
            peer.wait_ready()
    passes = {"on": [True], "off": [False], "both": [False, True]}[args.ray_quiet]
    tables = []
    try:
        for quiet in passes:  # each pass its own cluster; the engine alone is run in each
            tables.append((quiet, run_pass(args, peer, quiet)))
    finally:
        if peer is not None:
            peer.stop()
    names = (["llama.cpp"] if peer else []) + ["engine", "cluster"]
    for quiet, medians in tables:
        print()
        print(f"{cpu_name()}; {args.prompt_tokens} prompt tokens -> {args.output_tokens} output "
              f"tokens, greedy, streamed; median of {args.repeats} runs; {args.threads} threads; "
              f"fairserve dtype {args.dtype}; ray.quiet {'on' if quiet else 'off'}")
        if peer is None:
            print("llama.cpp: not run (see above)")
        print_table(medians, names)


def run_pass(args: argparse.Namespace, peer: llamacpp.LlamaServer | None, quiet: bool
             ) -> dict[int, dict[str, Run]]:
    """One cluster with `make up`'s settings (only the ports, the state directory, the dtype
    and ``ray.quiet`` set here) and a round of every system against it."""
    with tempfile.TemporaryDirectory(prefix="fairserve-peer-bench-") as state_dir:
        settings = load_settings(state_dir=state_dir, router={"port": free_port()},
                                 engine={"dtype": args.dtype}, ray={"quiet": quiet},
                                 redis={"port": free_port()}, tenants={"create_demo": False})
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="bench", max_queued=10_000))
            return asyncio.run(_main(args, peer, info.base_url, key,
                                     settings.engine.served_model_name))
        finally:
            cluster.stop()

if __name__ == "__main__":
    main()
