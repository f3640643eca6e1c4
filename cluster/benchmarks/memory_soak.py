"""Does Redis stay bounded under steady traffic? A soak of the real cluster.

    python -m cluster.benchmarks.memory_soak [--minutes 30] [--streams 8] [--output-tokens 32]
        [--prompt-tokens 400] [--idempotent-share 0.5] [--sample-s 60]

Starts ``fairserve``'s own launcher (``make up``'s shape: embedded Redis, one model replica,
one router, the real engine) and keeps ``--streams`` streamed completions running for
``--minutes``, each a fresh request (half of them, by default, with an ``Idempotency-Key``).
Every ``--sample-s`` it prints Redis's ``used_memory`` and key count, the requests finished so
far, the records still in their window with their streams and the digests (MEMORY USAGE of each
key), what is left of ``used_memory`` beyond them ("rest"), the router's resident memory and
Redis's estimate of the keys that expired but are not reclaimed yet (``expired_stale_perc``); at
the end, the keys by kind. An ended request's record and stream expire together after
``queues.resume_window_s`` (15 min); past it only an Idempotency-Key's digest stays (24 h).
So ``used_memory`` should rise for one resume window (the records of the requests that ended
within it), then follow the number of requests the window holds (which moves with the engine's
throughput on a noisy machine) plus the digests. Each sample therefore also weighs the records in
their window and the digests (MEMORY USAGE of each key), and what is left of ``used_memory``
beyond them ("rest") is what must stay flat. The last lines give the growth over the samples
after the first window: per request finished meanwhile, and per minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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
from cluster.ports import free_port
from cluster.settings import load_settings
from router.state.tenants import Tenant


@dataclass
class Sample:
    minute: float
    used_bytes: int
    num_keys: int
    num_finished: int
    router_rss_mb: float
    stale_percent: float  # Redis's estimate of keys expired but not yet reclaimed
    window_records: int  # ended or running requests' records still within their window
    window_bytes: int  # MEMORY USAGE of those records and their streams
    digest_bytes: int  # MEMORY USAGE of the Idempotency-Key digests

    @property
    def residue_bytes(self) -> int:
        """What ``used_memory`` holds beyond the records in their window and the digests: the
        part that must stay flat."""
        return self.used_bytes - self.window_bytes - self.digest_bytes


async def traffic(base_url: str, key: str, model: str, args: argparse.Namespace,
                  finished: list[int], stop: asyncio.Event) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base_url}/completions"

    async def stream(worker: int) -> None:
        n, rng = 0, random.Random(worker)
        async with httpx.AsyncClient(timeout=600) as http:
            while not stop.is_set():
                n += 1
                prompt = [1000 + (worker * 7919 + n * 104729 + j) % 20000
                          for j in range(args.prompt_tokens)]
                extra = ({"Idempotency-Key": uuid.uuid4().hex}
                         if rng.random() < args.idempotent_share else {})
                body = {"model": model, "prompt": prompt, "max_tokens": args.output_tokens,
                        "temperature": 0.7, "stream": True, "ignore_eos": True}
                async for _ in sse_events(http, url, body, {**headers, **extra},
                                          label="soak: "):
                    pass
                finished[0] += 1

    await asyncio.gather(*(stream(w) for w in range(args.streams)))


def census(client: redis.Redis) -> dict[str, tuple[int, int, int]]:
    """Redis's keys by kind (the part of the name after the tenant): how many, how many have no
    TTL, and their bytes (MEMORY USAGE)."""
    kinds: dict[str, list[int]] = {}
    for raw in client.scan_iter(count=1000):
        name = raw.decode()
        kind = name.split("}:", 1)[1].split(":", 1)[0] if "}:" in name else name.split(":")[1]
        entry = kinds.setdefault(kind, [0, 0, 0])
        entry[0] += 1
        entry[1] += client.ttl(raw) == -1
        entry[2] += client.memory_usage(raw, samples=0) or 0
    return {kind: (n, no_ttl, size) for kind, (n, no_ttl, size) in sorted(kinds.items())}


def sizes(client: redis.Redis, pattern: str) -> tuple[int, int]:
    """How many keys match ``pattern`` and their bytes (MEMORY USAGE, one pipeline)."""
    names = list(client.scan_iter(match=pattern, count=1000))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.memory_usage(name, samples=0)
    return len(names), sum(size or 0 for size in pipe.execute())


def sample(client: redis.Redis, started_s: float, finished: int, router: list[int]) -> Sample:
    info = client.info("memory")
    stale = float(client.info("stats").get("expired_stale_perc", 0.0))
    records, record_bytes = sizes(client, "fs:*:req:*")
    _, stream_bytes = sizes(client, "fs:*:stream:*")
    _, digest_bytes = sizes(client, "fs:*:idem:*")
    return Sample((time.monotonic() - started_s) / 60, int(info["used_memory"]),
                  int(client.dbsize()), finished, rss_mb(router), stale, records,
                  record_bytes + stream_bytes, digest_bytes)


async def soak(base_url: str, redis_url: str, key: str, model: str, args: argparse.Namespace,
               window_s: int) -> list[Sample]:
    client = redis.Redis.from_url(redis_url)
    router = find_processes()["router"]
    finished, stop = [0], asyncio.Event()
    task = asyncio.create_task(traffic(base_url, key, model, args, finished, stop))
    started = time.monotonic()
    samples = [sample(client, started, 0, router)]
    print(f"{'minute':>6} {'used MB':>9} {'keys':>7} {'finished':>9} {'in window':>10} "
          f"{'window MB':>10} {'digests MB':>11} {'rest MB':>8} {'router RSS MB':>14} "
          f"{'stale %':>8}", flush=True)
    while time.monotonic() - started < args.minutes * 60:
        await asyncio.sleep(args.sample_s)
        if task.done():
            task.result()  # a failure of the traffic ends the soak with its error
        samples.append(sample(client, started, finished[0], router))
        s = samples[-1]
        print(f"{s.minute:6.1f} {s.used_bytes / 2**20:9.2f} {s.num_keys:7d} "
              f"{s.num_finished:9d} {s.window_records:10d} {s.window_bytes / 2**20:10.2f} "
              f"{s.digest_bytes / 2**20:11.2f} {s.residue_bytes / 2**20:8.2f} "
              f"{s.router_rss_mb:14.0f} {s.stale_percent:8.1f}", flush=True)
    stop.set()
    await asyncio.wait_for(task, 600)
    print(f"\n{'keys by kind':<16} {'count':>7} {'no TTL':>7} {'KB':>9}")
    for kind, (n, no_ttl, size) in census(client).items():
        print(f"{kind:<16} {n:7d} {no_ttl:7d} {size / 1024:9.1f}")
    settled = [s for s in samples if s.minute * 60 >= window_s + args.sample_s]
    if len(settled) >= 2:
        first, last = settled[0], settled[-1]
        minutes = last.minute - first.minute
        done = max(1, last.num_finished - first.num_finished)
        grown = last.used_bytes - first.used_bytes
        rest = last.residue_bytes - first.residue_bytes
        digests = last.digest_bytes - first.digest_bytes
        print(f"\nafter the first resume window ({window_s} s), over {minutes:.1f} min and "
              f"{done} requests finished:\n"
              f"  used_memory {first.used_bytes / 2**20:.2f} -> {last.used_bytes / 2**20:.2f} MB"
              f" ({grown / done:+.0f} bytes per request; the window held "
              f"{first.window_records} -> {last.window_records} records)\n"
              f"  digests {digests / done:+.0f} bytes per request (kept 24 h)\n"
              f"  the rest (used_memory less the window's records and the digests) "
              f"{first.residue_bytes / 2**20:.2f} -> {last.residue_bytes / 2**20:.2f} MB: "
              f"{rest / done:+.0f} bytes per request, {rest / 1024 / minutes:+.1f} KB/min")
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
    parser.add_argument("--resume-window-s", type=int, default=None,
                        help="queues.resume_window_s (default: the settings' 15 min)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fairserve-soak-") as state_dir:
        queues = ({"resume_window_s": args.resume_window_s}
                  if args.resume_window_s is not None else {})
        settings = load_settings(state_dir=state_dir, router={"port": free_port()},
                                 redis={"port": free_port()}, tenants={"create_demo": False},
                                 queues=queues)
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
