"""Benchmark of the tenant queues against the embedded redis-server, beside redis-benchmark.

    python -m cluster.benchmarks.queue_bench [--requests 40000] [--workers 2] [--batch 32] [--rounds 3]

One run starts one embedded server and measures, on it:

- ``redis-benchmark -t lpush`` (the ceiling of a plain write on this server), plain and with
  16-deep pipelining;
- admissions/s: the admit script, pipelined ``--batch`` deep, from ``--workers`` processes;
- grant+complete cycles/s: each worker grants ``--batch`` requests per grant call and completes
  them in one pipeline; a cycle is one request granted, leased, completed and settled;
- both again from one client without pipelining (the latency-bound figure).

Each figure is the median of ``--rounds``; the machine is noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import cast

import redis.asyncio as aioredis

from cluster.redis_server import AppendFsync, EmbeddedRedis
from router.messages import AdmitRequest
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore

NUM_TENANTS = 10


def _tenant_of(index: int) -> str:
    return f"t{index % NUM_TENANTS}"


async def _queues(url: str) -> tuple[aioredis.Redis, TenantQueues]:
    client = connect(url)
    return client, TenantQueues(Scripts(client))


def _admit_worker(url: str, prefix: str, count: int, batch: int) -> float:
    async def work() -> float:
        client, queues = await _queues(url)
        requests = [AdmitRequest(_tenant_of(i), f"{prefix}-{i}", 50, 100, '{"b":1}')
                    for i in range(count)]
        started = time.perf_counter()
        for start in range(0, count, batch):
            await queues.admit_many(requests[start:start + batch])
        elapsed = time.perf_counter() - started
        await client.aclose()
        return elapsed

    return asyncio.run(work())


def _cycle_worker(url: str, holder: str, batch: int) -> tuple[int, float]:
    async def work() -> tuple[int, float]:
        client, queues = await _queues(url)
        num_cycles, started = 0, time.perf_counter()
        while grants := (await queues.grant(holder, batch, batch)).grants:
            await queues.complete_many([(g.lease, 50, 60, "stop") for g in grants])
            num_cycles += len(grants)
        elapsed = time.perf_counter() - started
        await client.aclose()
        return num_cycles, elapsed

    return asyncio.run(work())


def _parallel(worker: Callable[..., object], calls: list[tuple[object, ...]]) -> list[object]:
    with multiprocessing.get_context("spawn").Pool(len(calls)) as pool:
        return pool.starmap(worker, calls)


def _setup(url: str) -> None:
    async def work() -> None:
        client = connect(url)
        await client.flushall()
        store = TenantStore(Scripts(client))
        for i in range(NUM_TENANTS):
            await store.put(Tenant(id=f"t{i}", weight=1 + i % 3, max_queued=10_000_000))
        await client.aclose()

    asyncio.run(work())


def measure_queues(url: str, num_requests: int, num_workers: int, batch: int) -> dict[str, float]:
    _setup(url)
    share = num_requests // num_workers
    elapsed = cast(list[float], _parallel(
        _admit_worker, [(url, f"w{k}", share, batch) for k in range(num_workers)]))
    admitted = share * num_workers
    rates = {"admissions/s (pipelined)": admitted / max(elapsed)}
    cycles = cast(list[tuple[int, float]], _parallel(
        _cycle_worker, [(url, f"d{k}", batch) for k in range(num_workers)]))
    num_cycles = sum(n for n, _ in cycles)
    assert num_cycles == admitted, f"{num_cycles} cycles for {admitted} admissions"
    rates["grant+complete cycles/s (batched)"] = num_cycles / max(e for _, e in cycles)
    # one client, one script call at a time
    _setup(url)
    single = min(num_requests // 10, 5_000)
    rates["admissions/s (1 client, unpipelined)"] = single / _admit_worker(url, "s", single, 1)
    n, e = _cycle_worker(url, "s", 1)
    rates["grant+complete cycles/s (1 client, 1 at a time)"] = n / e
    return rates


def redis_benchmark_lpush(port: int, num_requests: int, pipeline: int) -> float | None:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    out = subprocess.run(
        [binary, "-p", str(port), "-t", "lpush", "-n", str(num_requests), "-P", str(pipeline),
         "-q"], capture_output=True, text=True, check=True, timeout=600).stdout
    match = re.search(r"LPUSH: ([\d.]+) requests per second", out.replace("\r", "\n"))
    return float(match.group(1)) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--appendfsync", choices=[p.value for p in AppendFsync],
                        default=AppendFsync.EVERYSEC.value)
    args = parser.parse_args(argv)
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            EmbeddedRedis(tmp, appendfsync=AppendFsync(args.appendfsync)) as server:
        for _ in range(args.rounds):
            for pipeline in (1, 16):
                lpush = redis_benchmark_lpush(server.port, 200_000, pipeline)
                if lpush is not None:
                    rows.setdefault(f"redis-benchmark LPUSH/s (-P {pipeline})", []).append(lpush)
            for name, rate in measure_queues(server.url, args.requests, args.workers,
                                             args.batch).items():
                rows.setdefault(name, []).append(rate)
        version = server.client().info("server")["redis_version"]
    if not any(k.startswith("redis-benchmark") for k in rows):
        print("(redis-benchmark not found: apt-get install redis-tools for the LPUSH baseline)")
    print(f"redis-server {version}, appendfsync {args.appendfsync}, {args.workers} worker "
          f"processes, batch {args.batch}, {args.requests} requests, median of {args.rounds}\n")
    baseline = statistics.median(rows.get("redis-benchmark LPUSH/s (-P 1)", [0.0])) or None
    print(f"| {'measure':<48} | {'ops/s':>10} | {'vs LPUSH -P 1':>13} |")
    print(f"| {'-' * 48} | {'-' * 9}: | {'-' * 12}: |")
    for name, values in rows.items():
        median = statistics.median(values)
        ratio = f"{median / baseline:.2f}x" if baseline else "-"
        print(f"| {name:<48} | {median:>10,.0f} | {ratio:>13} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
