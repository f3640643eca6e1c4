"""Prefix-cache-aware replica choice: a multi-turn chat workload on two replicas, routed by
load only (``least_loaded``: Ray Serve's power of two choices) and by prefix affinity
(``prefix_affinity``, ``router/dispatch/prefix_affinity.py``), in one run.

    python -m cluster.benchmarks.affinity_bench [--policies least_loaded prefix_affinity]
        [--conversations 16] [--turns 4] [--concurrency 8] [--system-words 250]
        [--user-words 40] [--output-tokens 32]

Per policy, a cluster as ``make up`` runs it with two model replicas (only the ports, the state
directory, ``replicas.num_replicas`` and ``replicas.routing.policy`` moved). Every conversation
shares one system prompt and keeps its own history: each turn sends the system prompt, all
earlier turns (the user's messages and the model's replies) and a new user message, streamed
over the chat API, greedy, exactly ``--output-tokens`` tokens per reply. ``--concurrency``
conversations run at once, each one turn after the other. The same seed gives both policies
the same messages, and greedy decoding the same replies. The table: time to first token p50 and
p99 over all turns and over follow-up turns (2nd and later), output tokens per second over the
whole workload, and the share of prompt tokens the replicas served from their prefix caches
(``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from cluster.benchmarks.engine_bench import WORDS
from cluster.benchmarks.peer_bench import cpu_name
from cluster.benchmarks.sse import percentile, sse_events
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from router.state.tenants import Tenant


@dataclass(slots=True)
class Turn:
    conversation: int
    index: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class PolicyResult:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    output_tokens: int = 0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def chat(http: httpx.AsyncClient, url: str, key: str, model: str,
               messages: list[dict[str, str]], num_out: int) -> tuple[float, str, dict]:
    """One streamed chat turn: (time to first token, the reply, the final usage)."""
    body = {"model": model, "messages": messages, "max_tokens": num_out, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    usage: dict = {}
    async for event in sse_events(http, url, body, {"Authorization": f"Bearer {key}"}):
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content")
            if text:
                if not first:
                    first = time.perf_counter()
                parts.append(text)
        usage = event.get("usage") or usage
    if usage.get("completion_tokens") != num_out:
        raise RuntimeError(f"a reply ended after {usage.get('completion_tokens')} tokens")
    return first - start, "".join(parts), usage


async def run_workload(args: argparse.Namespace, base_url: str, model: str, key: str,
                       result: PolicyResult) -> None:
    rng = random.Random(args.seed)
    system = words(rng, args.system_words)
    user_turns = [[words(rng, args.user_words) for _ in range(args.turns)]
                  for _ in range(args.conversations)]
    url = f"{base_url}/chat/completions"
    pending = list(range(args.conversations))

    async def conversation(http: httpx.AsyncClient, c: int) -> None:
        messages = [{"role": "system", "content": system}]
        for t, text in enumerate(user_turns[c]):
            messages.append({"role": "user", "content": text})
            ttft, reply, usage = await chat(http, url, key, model, messages, args.output_tokens)
            messages.append({"role": "assistant", "content": reply})
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            result.turns.append(Turn(c, t, ttft, int(usage["prompt_tokens"]), cached))
            result.output_tokens += int(usage["completion_tokens"])

    async def worker(http: httpx.AsyncClient) -> None:
        while pending:
            await conversation(http, pending.pop(0))

    async with httpx.AsyncClient(timeout=600) as http:
        # warm-up: one short request per replica's worth, outside the measure
        await chat(http, url, key, model, [{"role": "user", "content": "Hello."}], 2)
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
        result.wall_s = time.perf_counter() - start


def run_policy(args: argparse.Namespace, policy: str) -> PolicyResult:
    result = PolicyResult(policy)
    with tempfile.TemporaryDirectory(prefix="fairserve-affinity-bench-") as state_dir:
        settings = load_settings(
            state_dir=state_dir, router={"port": free_port()}, redis={"port": free_port()},
            replicas={"num_replicas": args.replicas, "routing": {"policy": policy}},
            tenants={"create_demo": False})
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="chat", max_queued=10_000))
            asyncio.run(run_workload(args, info.base_url, settings.engine.served_model_name,
                                     key, result))
        finally:
            cluster.stop()
    print(f"{policy}: {len(result.turns)} turns in {result.wall_s:.1f} s", flush=True)
    return result


def print_table(results: list[PolicyResult]) -> None:
    header = (f"{'policy':<15} | {'TTFT p50 ms':>11} | {'TTFT p99 ms':>11} | "
              f"{'follow-up p50':>13} | {'follow-up p99':>13} | {'out tok/s':>9} | "
              f"{'cached prompt':>13}")
    print(header)
    print("-" * len(header))
    for r in results:
        ttft = [t.ttft_s * 1e3 for t in r.turns]
        later = [t.ttft_s * 1e3 for t in r.turns if t.index > 0]
        cached = sum(t.cached_tokens for t in r.turns) / max(1, sum(t.prompt_tokens
                                                                     for t in r.turns))
        print(f"{r.policy:<15} | {percentile(ttft, 50):>11.1f} | {percentile(ttft, 99):>11.1f} | "
              f"{percentile(later, 50):>13.1f} | {percentile(later, 99):>13.1f} | "
              f"{r.output_tokens / r.wall_s:>9.1f} | {cached:>12.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", default=["least_loaded", "prefix_affinity"],
                        choices=["least_loaded", "prefix_affinity"])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=250)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.turns < 2:
        parser.error("--turns must be at least 2: follow-up turns are what affinity serves")
    results = [run_policy(args, policy) for policy in args.policies]
    print()
    print(f"{cpu_name()}; {args.replicas} replicas; {args.conversations} conversations x "
          f"{args.turns} turns, {args.concurrency} at once; system prompt {args.system_words} "
          f"words shared by all, {args.user_words} words per user turn, {args.output_tokens} "
          f"tokens per reply; p99 is the nearest rank")
    print_table(results)


if __name__ == "__main__":
    main()
