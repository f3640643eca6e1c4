"""Autoscaling reaction time: from a backlog rising to a new replica serving, phase by phase.

    python -m cluster.benchmarks.autoscale_bench [--rounds 3] [--burst 60] [--output-tokens 64]
                                      [--variants prepared gguf] [--plot PATH.svg]

One cluster (``fairserve``'s launcher: embedded Redis, local Ray of 2 CPUs, the default model,
replicas of 0.5 CPU and one torch thread, autoscaling 1-2 on the backlog with the default
``AutoscaleSettings`` except a short ``downscale_delay_s`` so rounds follow each other and a
``target_drain_s`` of 10 s, so the burst is a backlog worth a second replica on fast machines). Each
round sends a burst of ``--burst`` requests at once to a cluster of one idle replica, then
watches Redis every 0.1 s for three moments, each measured from the burst's start:

* decided: the autoscaler's published decision asks for 2 replicas (the backlog read, the
  drain estimate passing its target, ``upscale_delay_s``);
* started: the new replica's first load report (Ray started its actor, the engine loaded);
* serving: the new replica holds a request (the router saw it and granted it work).

The burst is then waited out, the deployment left to return to one replica, and the next round
begins. Every poll also samples the backlog (the autoscaler's own backlog script), the replicas
the autoscaler asks for, those reporting and those serving; ``--plot PATH`` draws the first
round's samples of the first variant as an SVG chart (``cluster/benchmarks/plot.py``). Variants, each on a cluster of its own, one after the other: *prepared* replicas load
the model from its prepared copy (``engine.model_cache_dir``, the default), *gguf* ones parse
and dequantize the GGUF file at every start (``model_cache_dir: null``). The table shows every
round and the medians; beside them, Ray Serve's default policy waits ``upscale_delay_s`` = 30 s
of sustained load before it even asks for a replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
import redis.asyncio as aioredis

from cluster.autoscaling import AutoscaleSettings
from cluster.benchmarks.plot import Panel, Series, write_chart
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from replicas.protocol import ReplicaLoad
from router.state import keys
from router.state.capacity import read_loads
from router.state.redis_client import connect
from router.state.scripts import Script, script_source
from router.state.tenants import Tenant

RAY_DEFAULT_UPSCALE_DELAY_S = 30.0
POLL_S = 0.1
VARIANTS = ("prepared", "gguf")


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # from the burst's start
    backlog_tokens: int  # queued, not yet granted (the autoscaler's backlog script)
    wanted: int  # replicas the autoscaler's last published decision asks for
    reporting: int  # replicas with a load report
    serving: int  # replicas holding at least one request


@dataclass(frozen=True, slots=True)
class Round:
    decided_s: float | None  # None: the decision record was not seen (overwritten in between)
    started_s: float | None  # None: the load report appeared after the first grant's poll
    serving_s: float
    queued_tokens: int  # the backlog the scale-up decision saw
    timeline: list[Sample]


async def one_round(client: openai.AsyncOpenAI, redis_url: str, model: str, burst: int,
                    output_tokens: int, timeout_s: float = 180.0) -> Round:
    redis = connect(redis_url)
    try:
        (first,) = await _until(redis, lambda loads: len(loads) == 1, timeout_s)
        start = time.monotonic()
        tasks = [asyncio.create_task(_ask(client, model, i, output_tokens)) for i in range(burst)]
        burst_done = asyncio.ensure_future(asyncio.gather(*tasks))
        decided = started = serving = None
        queued = 0
        timeline: list[Sample] = []
        while not (serving is not None and burst_done.done()):
            now = time.monotonic() - start
            if now > timeout_s:
                raise TimeoutError(f"burst not served with a second replica after {timeout_s} s")
            raw = await redis.get(keys.autoscaler())
            record = json.loads(raw) if raw else {}
            if decided is None and record.get("decision_replicas", 0) >= 2:
                decided, queued = now, int(record.get("queued_tokens", 0))
            loads = await read_loads(redis)
            others = [x for x in loads if x.replica_id != first.replica_id]
            if others and started is None:
                started = now
            if serving is None and any(x.ongoing > 0 for x in others):
                serving = now
            timeline.append(Sample(now, await _backlog_tokens(redis),
                                   int(record.get("decision_replicas", 1)), len(loads),
                                   sum(1 for x in loads if x.ongoing > 0)))
            await asyncio.sleep(POLL_S)
        await burst_done
        await _until(redis, lambda loads: len(loads) == 1, timeout_s)  # back to one
        assert serving is not None
        return Round(decided, started, serving, queued, timeline)
    finally:
        await redis.aclose()


async def _backlog_tokens(redis: aioredis.Redis) -> int:
    rows = await redis.eval(script_source(Script.BACKLOG), 0, "")  # tenant, pool, ..., tokens
    return sum(int(r[4]) for r in rows)


def plot_round(path: str, variant: str, r: Round, burst: int, output_tokens: int) -> None:
    def series(name: str, values: list[float]) -> Series:
        return Series(name, [(x.t_s, v) for x, v in zip(r.timeline, values, strict=True)])

    marks = [(t, label) for t, label in ((r.decided_s, "decided"), (r.started_s, "up"),
                                         (r.serving_s, "serving")) if t is not None]
    backlog = Panel("backlog (tokens)",
                    [series("queued tokens", [x.backlog_tokens for x in r.timeline])], marks)
    replicas = Panel("replicas", [series("asked for", [x.wanted for x in r.timeline]),
                                  series("reporting", [x.reporting for x in r.timeline]),
                                  series("serving", [x.serving for x in r.timeline])], marks)
    title = (f"Autoscaling on the backlog: a burst of {burst} x {output_tokens} tokens "
             f"({variant} replicas)")
    print(f"plot: {write_chart(path, title, 'seconds from the burst', [backlog, replicas])}")


async def _until(redis: aioredis.Redis, predicate: Callable[[list[ReplicaLoad]], bool],
                 timeout_s: float) -> list[ReplicaLoad]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = await read_loads(redis)
        if predicate(loads):
            return loads
        await asyncio.sleep(0.25)
    raise TimeoutError(f"replica count not as wanted after {timeout_s} s")


async def _ask(client: openai.AsyncOpenAI, model: str, i: int, output_tokens: int) -> None:
    response = await client.completions.create(
        model=model, prompt=f"Request {i}: list some numbers.", max_tokens=output_tokens,
        extra_body={"min_tokens": output_tokens}, temperature=0.0)
    assert response.usage is not None and response.usage.completion_tokens == output_tokens


async def measure(args: argparse.Namespace, base_url: str, key: str, redis_url: str,
                  model: str) -> list[Round]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    rounds = []
    try:
        await _ask(client, model, -1, 4)  # warm
        for i in range(args.rounds):
            rounds.append(await one_round(client, redis_url, model, args.burst,
                                          args.output_tokens))
            r = rounds[-1]
            print(f"round {i + 1}: decided {_s(r.decided_s)} s, started {_s(r.started_s)} s, "
                  f"serving {r.serving_s:.1f} s", flush=True)
    finally:
        await client.close()
    return rounds


def print_table(results: dict[str, list[Round]], scaling: AutoscaleSettings) -> None:
    header = (f"{'variant':<8} | {'round':>6} | {'decided s':>9} | {'replica up s':>12} | "
              f"{'serving s':>9} | {'backlog tokens':>14}")
    print(header)
    print("-" * len(header))
    for variant, rounds in results.items():
        for i, r in enumerate(rounds, 1):
            print(f"{variant:<8} | {i:>6} | {_s(r.decided_s):>9} | {_s(r.started_s):>12} | "
                  f"{r.serving_s:>9.1f} | {r.queued_tokens:>14}")
        print(f"{variant:<8} | {'median':>6} | "
              f"{_s(_median([r.decided_s for r in rounds])):>9} | "
              f"{_s(_median([r.started_s for r in rounds])):>12} | "
              f"{statistics.median(r.serving_s for r in rounds):>9.1f} |")
        print("-" * len(header))
    if len(results) == 2:
        (a, ra), (b, rb) = results.items()
        ratio = (statistics.median(r.serving_s for r in ra)
                 / statistics.median(r.serving_s for r in rb))
        print(f"median serving time, {a} / {b}: {ratio:.2f}")
    print(f"\nfairserve: upscale_delay_s {scaling.upscale_delay_s} s, target_drain_s "
          f"{scaling.target_drain_s} s; Ray Serve's default policy: upscale_delay_s "
          f"{RAY_DEFAULT_UPSCALE_DELAY_S:.0f} s before it asks for a replica at all")


def _median(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None]
    return statistics.median(seen) if seen else None


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_variant(args: argparse.Namespace, scaling: AutoscaleSettings, variant: str
                ) -> list[Round]:
    engine: dict[str, Any] = {"num_threads": 1, "max_num_seqs": 8, "kv_cache_bytes": 256 * 2**20}
    if variant == "gguf":
        engine["model_cache_dir"] = None
    with tempfile.TemporaryDirectory(prefix="fairserve-autoscale-bench-") as state_dir:
        settings = load_settings(
            state_dir=state_dir, engine=engine,
            replicas={"num_cpus": 0.5, "max_ongoing_requests": 8,
                      "graceful_shutdown_timeout_s": 30, "autoscaling": scaling.model_dump()},
            router={"num_replicas": 1, "num_cpus": 0.25, "port": free_port()},
            redis={"port": free_port()}, ray={"num_cpus": 2},
            tenants={"create_demo": False},
        )
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="bench", max_queued=10_000))
            print(f"variant {variant}:", flush=True)
            return asyncio.run(measure(args, info.base_url, key, info.redis_url,
                                       settings.engine.served_model_name))
        finally:
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--plot", metavar="PATH.svg",
                        help="draw the first variant's first round as an SVG chart")
    args = parser.parse_args()
    # downscale_delay_s: short, so rounds follow each other, and longer than a replica's start,
    # or a backlog draining faster than estimated takes the scale-up back before it serves;
    # target_drain_s: half the default, so the burst asks for a second replica even where one
    # replica decodes 200 tokens a second (60 x 64 tokens drain in ~19 s there)
    scaling = AutoscaleSettings(min_replicas=1, max_replicas=2, downscale_delay_s=20.0,
                                target_drain_s=10.0)
    results = {variant: run_variant(args, scaling, variant) for variant in args.variants}
    print()
    print(f"burst of {args.burst} requests x {args.output_tokens} output tokens at one idle "
          "replica (0.5 CPU, 1 torch thread, default model); times from the burst's start")
    print_table(results, scaling)
    if args.plot:
        variant = args.variants[0]
        plot_round(args.plot, variant, results[variant][0], args.burst, args.output_tokens)


if __name__ == "__main__":
    main()
