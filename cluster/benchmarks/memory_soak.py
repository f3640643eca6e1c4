"""Does Redis stay bounded under steady traffic? A soak of the real cluster.

    python -m cluster.benchmarks.memory_soak [--minutes 30] [--streams 8] [--output-tokens 32]
        [--prompt-tokens 400] [--idempotent-share 0.5] [--sample-s 60]

Starts ``fairserve``'s own launcher (``make up``'s shape: embedded Redis, one model replica,
one router, the real engine) and keeps ``--streams`` streamed completions running for
``--minutes``, each a fresh request (half of them, by default, with an ``Idempotency-Key``).
Every ``--sample-s`` it prints Redis's ``used_memory`` and key count, the requests finished so
far and the router's resident memory. An ended request's record and stream expire together
after ``queues.resume_window_s`` (15 min); past it only an Idempotency-Key's digest stays (24 h).
So ``used_memory`` should rise for one resume window (the records of the requests that ended
within it), then stay flat but for the digests. The last lines give the growth over the
samples after the first window: per minute, and per request finished meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from dataclasses import dataclass

import httpx
import redis

from cluster.benchmarks.peer_bench import cpu_name
from cluster.benchmarks.serving_path import find_processes, rss_mb
from cluster.benchmarks.sse import sse_events
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.redis_server import free_port
from cluster.settings import load_settings
from router.state.tenants import Tenant


@dataclass
class Sample:
    minute: float
    used_bytes: int
    num_keys: int
    num_finished: int
    router_rss_mb: float


async def traffic(base_url: str, key: str, model: str, args: argparse.Namespace,
                  finished: list[int], stop: asyncio.Event) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base_url}/completions"

    async def stream(worker: int) -> None:
        n = 0
        async with httpx.AsyncClient(timeout=600) as http:
            while not stop.is_set():
                n += 1
                prompt = [1000 + (worker * 7919 + n * 104729 + j) % 20000
                          for j in range(args.prompt_tokens)]
                extra = ({"Idempotency-Key": uuid.uuid4().hex}
                         if (n % 100) < args.idempotent_share * 100 else {})
                body = {"model": model, "prompt": prompt, "max_tokens": args.output_tokens,
                        "temperature": 0.7, "stream": True, "ignore_eos": True}
                async for _ in sse_events(http, url, body, {**headers, **extra},
                                          label="soak: "):
                    pass
                finished[0] += 1

    await asyncio.gather(*(stream(w) for w in range(args.streams)))


def sample(client: redis.Redis, started_s: float, finished: int, router: list[int]) -> Sample:
    info = client.info("memory")
    return Sample((time.monotonic() - started_s) / 60, int(info["used_memory"]),
                  int(client.dbsize()), finished, rss_mb(router))


async def soak(base_url: str, redis_url: str, key: str, model: str, args: argparse.Namespace,
               window_s: int) -> list[Sample]:
    client = redis.Redis.from_url(redis_url)
    router = find_processes()["router"]
    finished, stop = [0], asyncio.Event()
    task = asyncio.create_task(traffic(base_url, key, model, args, finished, stop))
    started = time.monotonic()
    samples = [sample(client, started, 0, router)]
    print(f"{'minute':>6} {'used MB':>9} {'keys':>7} {'finished':>9} {'router RSS MB':>14}",
          flush=True)
    while time.monotonic() - started < args.minutes * 60:
        await asyncio.sleep(args.sample_s)
        if task.done():
            task.result()  # a failure of the traffic ends the soak with its error
        samples.append(sample(client, started, finished[0], router))
        s = samples[-1]
        print(f"{s.minute:6.1f} {s.used_bytes / 2**20:9.2f} {s.num_keys:7d} "
              f"{s.num_finished:9d} {s.router_rss_mb:14.0f}", flush=True)
    stop.set()
    await asyncio.wait_for(task, 600)
    settled = [s for s in samples if s.minute * 60 >= window_s + args.sample_s]
    if len(settled) >= 2:
        first, last = settled[0], settled[-1]
        minutes = last.minute - first.minute
        grown = last.used_bytes - first.used_bytes
        done = max(1, last.num_finished - first.num_finished)
        print(f"\nafter the first resume window ({window_s} s): used_memory "
              f"{first.used_bytes / 2**20:.2f} -> {last.used_bytes / 2**20:.2f} MB over "
              f"{minutes:.1f} min: {grown / 1024 / minutes:+.1f} KB/min, "
              f"{grown / done:+.0f} bytes per request finished meanwhile ({done})")
    else:
        print(f"\nthe soak was shorter than one resume window ({window_s} s) plus a sample")
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--idempotent-share", type=float, default=0.5)
    parser.add_argument("--sample-s", type=float, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fairserve-soak-") as state_dir:
        settings = load_settings(state_dir=state_dir, router={"port": free_port()},
                                 redis={"port": free_port()}, tenants={"create_demo": False})
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="soak", max_queued=10_000))
            print(f"\n{cpu_name()}; {os.cpu_count()} cores; {args.streams} streams, "
                  f"{args.prompt_tokens} prompt -> {args.output_tokens} output tokens, "
                  f"{args.minutes:g} min", flush=True)
            asyncio.run(soak(info.base_url, info.redis_url, key,
                             settings.engine.served_model_name, args,
                             settings.queues.resume_window_s))
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
