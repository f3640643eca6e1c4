"""Fairness inside the replica: a quiet tenant's time to first token alone and under another
tenant's flood, with the engine's scheduling policy ``fcfs`` (arrival order, as before) and
``fair`` (per-tenant token counters, ``replicas/torch_engine/policies.py``), in one run.

    python -m cluster.benchmarks.fairness_bench [--policies fcfs fair fair:512] [--quiet-requests 30]
        [--noisy-streams 16] [--quiet-prompt-tokens 100] [--quiet-output-tokens 32]
        [--noisy-prompt-tokens 100] [--noisy-output-tokens 64] [--warmup-s 5]

Per policy, a cluster as ``make up`` runs it (one replica, one router; only the ports, the state
directory and ``engine.scheduling_policy`` moved) and two tenants of equal weight:
- solo: the quiet tenant sends ``--quiet-requests`` requests one after the other;
- flood: the noisy tenant keeps ``--noisy-streams`` streams open (each ends and is replaced at
  once); after ``--warmup-s`` the quiet tenant sends the same number of requests one at a time.
  The noisy tenant's throughput is its output tokens received while the quiet tenant ran,
  per second (counted from the streams' continuous usage).
Prompts are distinct token ids (no prefix-cache help), greedy, every request generates exactly
its output tokens (``ignore_eos``), streamed over HTTP. The table: the quiet tenant's TTFT p50
and p99 solo and under the flood, their ratios, and the noisy tenant's tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from cluster.benchmarks.engine_bench import make_prompts
from cluster.benchmarks.peer_bench import cpu_name
from cluster.benchmarks.sse import percentile, sse_events
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from replicas.engine.config import EngineConfig
from replicas.torch_engine.loader import load_model_source
from router.state.tenants import Tenant


@dataclass(slots=True)
class PolicyResult:
    policy: str
    solo_ttft_s: list[float] = field(default_factory=list)
    flood_ttft_s: list[float] = field(default_factory=list)
    # the quiet requests' phases as the server reports them (usage.timings_ms)
    solo_phases: list[dict[str, float]] = field(default_factory=list)
    flood_phases: list[dict[str, float]] = field(default_factory=list)
    noisy_tokens_per_s: float = 0.0
    noisy_requests: int = 0


class Client:
    def __init__(self, http: httpx.AsyncClient, base_url: str, model: str) -> None:
        self.http = http
        self.url = f"{base_url}/completions"
        self.model = model

    async def stream(self, key: str, ids: list[int], num_out: int,
                     on_tokens: callable | None = None,  # type: ignore[valid-type]
                     phases: list[dict[str, float]] | None = None) -> float:
        """One streamed request; its time to first token in seconds. ``on_tokens(n, t)`` is
        called with the output tokens each chunk brings and when it came; ``phases`` gets the
        server's ``timings_ms`` (queue, engine_queue, prefill, decode)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": num_out, "temperature": 0,
                "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        start = time.perf_counter()
        first = 0.0
        seen = 0
        timings: dict[str, float] | None = None
        headers = {"Authorization": f"Bearer {key}"}
        async for event in sse_events(self.http, self.url, body, headers):
            now = time.perf_counter()
            if event.get("choices") and not first:
                first = now
            usage = event.get("usage")
            if usage is not None:
                done = int(usage["completion_tokens"])
                if on_tokens is not None and done > seen:
                    on_tokens(done - seen, now)
                seen = max(seen, done)
                if "timings_ms" in usage and not event["choices"]:
                    timings = usage["timings_ms"]
        if seen != num_out:
            raise RuntimeError(f"a request ended after {seen} of {num_out} tokens")
        if phases is not None:  # one entry per request, kept beside its TTFT
            if timings is None:
                raise RuntimeError("the final usage chunk had no timings_ms")
            phases.append(timings)
        return first - start


def run_policy(args: argparse.Namespace, policy: str, tokenizer: object) -> PolicyResult:
    result = PolicyResult(policy)
    with tempfile.TemporaryDirectory(prefix="fairserve-fairness-bench-") as state_dir:
        name, _, cap = policy.partition(":")
        engine: dict[str, object] = {"scheduling_policy": name}
        if cap:
            engine["max_prompt_tokens_with_decodes"] = int(cap)
        settings = load_settings(state_dir=state_dir, router={"port": free_port()},
                                 engine=engine,
                                 redis={"port": free_port()}, tenants={"create_demo": False})
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            quiet = add_tenant_with_key(info.redis_url, Tenant(id="quiet"))
            noisy = add_tenant_with_key(info.redis_url, Tenant(id="noisy", max_queued=10_000))
            asyncio.run(_measure(args, info.base_url, settings.engine.served_model_name, quiet,
                                 noisy, tokenizer, result))
        finally:
            cluster.stop()
    return result


async def _measure(args: argparse.Namespace, base_url: str, model: str, quiet: str,
                   noisy: str, tokenizer: object, result: PolicyResult) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        await _phases(args, Client(http, base_url, model), quiet, noisy, tokenizer, result)


async def _phases(args: argparse.Namespace, client: Client, quiet: str, noisy: str,
                  tokenizer: object, result: PolicyResult) -> None:
    seed = iter(range(1, 1_000_000))

    def prompts(n: int, length: int) -> list[list[int]]:
        return make_prompts(tokenizer, n, length, seed=next(seed))  # type: ignore[arg-type]

    for ids in prompts(2, args.quiet_prompt_tokens):  # warm-up
        await client.stream(quiet, ids, 4)
    for ids in prompts(args.quiet_requests, args.quiet_prompt_tokens):
        result.solo_ttft_s.append(await client.stream(quiet, ids, args.quiet_output_tokens,
                                                      phases=result.solo_phases))
    print(f"{result.policy}: solo TTFT p50 {statistics.median(result.solo_ttft_s) * 1e3:.0f} ms",
          flush=True)

    window: list[float] = []  # [start, end] of the quiet tenant's flood phase
    marks: list[tuple[float, int]] = []
    stopping = asyncio.Event()

    def on_tokens(n: int, at: float) -> None:
        marks.append((at, n))

    async def noisy_stream() -> None:
        while not stopping.is_set():
            (ids,) = prompts(1, args.noisy_prompt_tokens)
            await client.stream(noisy, ids, args.noisy_output_tokens, on_tokens)
            result.noisy_requests += 1

    floods = [asyncio.create_task(noisy_stream()) for _ in range(args.noisy_streams)]
    try:
        await asyncio.sleep(args.warmup_s)
        window.append(time.perf_counter())
        for ids in prompts(args.quiet_requests, args.quiet_prompt_tokens):
            result.flood_ttft_s.append(await client.stream(quiet, ids, args.quiet_output_tokens,
                                                           phases=result.flood_phases))
        window.append(time.perf_counter())
    finally:
        await stop_floods(floods, stopping)
    start, end = window
    noisy_tokens = sum(n for at, n in marks if start <= at <= end)
    result.noisy_tokens_per_s = noisy_tokens / (end - start)
    print(f"{result.policy}: flood TTFT p50 {statistics.median(result.flood_ttft_s) * 1e3:.0f} ms,"
          f" noisy {result.noisy_tokens_per_s:.1f} tok/s", flush=True)


async def stop_floods(floods: list[asyncio.Task[None]], stopping: asyncio.Event,
                      timeout_s: float = 300) -> None:
    """Stops the flood's streams (each ends its request first, up to ``timeout_s``); a
    stream that failed fails the run."""
    stopping.set()
    done, _ = await asyncio.wait(floods, timeout=timeout_s)
    for task in floods:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


def ttft_header(high: int) -> str:
    """The columns of a TTFT comparison: p50 and p``high`` solo and under a flood, ratios."""
    return (f"{'solo p50 ms':>11} | {f'solo p{high} ms':>11} | {'flood p50 ms':>12} | "
            f"{f'flood p{high} ms':>12} | {'p50 x solo':>10} | {f'p{high} x solo':>10}")


def ttft_cells(solo_s: list[float], flood_s: list[float], high: int) -> str:
    """One row of ``ttft_header``'s columns."""
    s50, sh = percentile(solo_s, 50) * 1e3, percentile(solo_s, high) * 1e3
    f50, fh = percentile(flood_s, 50) * 1e3, percentile(flood_s, high) * 1e3
    return (f"{s50:>11.1f} | {sh:>11.1f} | {f50:>12.1f} | {fh:>12.1f} | "
            f"{f50 / s50:>9.2f}x | {fh / sh:>9.2f}x")


def print_table(results: list[PolicyResult]) -> None:
    header = f"{'policy':<8} | {ttft_header(99)} | {'noisy tok/s':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.policy:<8} | {ttft_cells(r.solo_ttft_s, r.flood_ttft_s, 99)} | "
              f"{r.noisy_tokens_per_s:>11.1f}")


PHASES = ("queue", "engine_queue", "prefill")


def _hops_ms(ttft_s: float, phases: dict[str, float]) -> float:
    """The part of a time to first token outside the server's phases: the client's request
    reaching the router, the call to the replica, the first token's way back."""
    return ttft_s * 1e3 - sum(phases.get(n, 0.0) for n in PHASES)


def print_phases(results: list[PolicyResult]) -> None:
    """Where the quiet requests' time to first token went (medians of the server's timings,
    and what is left of the client's TTFT: the hops)."""
    names = (*PHASES, "hops")
    header = f"{'policy':<8} | {'phase':<5} | " + " | ".join(f"{n + ' ms':>15}" for n in names)
    print(header)
    print("-" * len(header))
    for r in results:
        for label, ttfts, phases in (("solo", r.solo_ttft_s, r.solo_phases),
                                     ("flood", r.flood_ttft_s, r.flood_phases)):
            rows = [[p.get(n, 0.0) for n in PHASES] + [_hops_ms(t, p)]
                    for t, p in zip(ttfts, phases, strict=True)]
            cells = [statistics.median(col) for col in zip(*rows, strict=True)] if rows else \
                [float("nan")] * len(names)
            print(f"{r.policy:<8} | {label:<5} | " + " | ".join(f"{c:>15.1f}" for c in cells))


def print_worst(results: list[PolicyResult], n: int = 3) -> None:
    """The slowest quiet requests under the flood, with their phases: what a p99 is made of."""
    for r in results:
        worst = sorted(zip(r.flood_ttft_s, r.flood_phases, strict=False), key=lambda x: -x[0])[:n]
        cells = ", ".join(f"{t * 1e3:.0f} ms (" + " ".join(
            f"{k} {p.get(k, 0):.0f}" for k in PHASES) + f" hops {_hops_ms(t, p):.0f})"
            for t, p in worst)
        print(f"{r.policy}: slowest under the flood: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", default=["fcfs", "fair"],
                        help="fcfs, fair, or fair:N (engine.max_prompt_tokens_with_decodes N)")
    parser.add_argument("--quiet-requests", type=int, default=30)
    parser.add_argument("--noisy-streams", type=int, default=16)
    parser.add_argument("--quiet-prompt-tokens", type=int, default=100)
    parser.add_argument("--quiet-output-tokens", type=int, default=32)
    parser.add_argument("--noisy-prompt-tokens", type=int, default=100)
    parser.add_argument("--noisy-output-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    args = parser.parse_args()
    tokenizer = load_model_source(EngineConfig().model).tokenizer
    results = [run_policy(args, policy, tokenizer) for policy in args.policies]
    print()
    print(f"{cpu_name()}; quiet: {args.quiet_requests} requests one at a time, "
          f"{args.quiet_prompt_tokens} -> {args.quiet_output_tokens} tokens; noisy: "
          f"{args.noisy_streams} streams, {args.noisy_prompt_tokens} -> "
          f"{args.noisy_output_tokens} tokens; equal weights; p99 is the nearest rank "
          f"(the worst of {args.quiet_requests}); ratios: flood over solo of the same policy")
    print_table(results)
    print()
    print("the quiet requests' phases, medians of the server's usage.timings_ms (queue: the "
          "tenant queue; engine_queue: arrival at the replica to first scheduled; prefill: first "
          "scheduled to first token; hops: the client's TTFT less those, i.e. HTTP, proxy, "
          "router and the Ray calls both ways)")
    print_phases(results)
    print_worst(results)


if __name__ == "__main__":
    main()
