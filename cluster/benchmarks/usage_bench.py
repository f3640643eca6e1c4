"""What the usage records cost: request lifetimes on one redis-server with them on and off.

    python -m cluster.benchmarks.usage_bench [--requests 3000] [--rounds 5]

A lifetime is what the queue scripts do for one served request: admitted (pipelined 32 deep),
granted (32 per grant call) and completed with its terminal event (one pipeline per 32). With
usage records on, ``admit.lua`` and ``complete.lua`` also write the tenant's hourly record (no
extra round trip). Each round runs both, in alternating order, on fresh keys; the table gives
the median wall time and redis-server CPU per request of each, and their ratio. No model and
no cluster: this is the part of the serving path the records touch.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time

from cluster.benchmarks.serving_path import cpu_seconds
from cluster.redis_server import EmbeddedRedis
from router.dispatch.response_events import end_data
from router.messages import AdmitRequest, RequestState
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Script, Scripts
from router.state.tenants import Tenant, TenantStore

BATCH = 32
TENANTS = 10
TIMINGS = {"admitted_s": 1.0, "granted_s": 1.1, "arrived_s": 1.2, "finished_s": 2.0}


async def _lifetimes(queues: TenantQueues, prefix: str, count: int) -> None:
    for start in range(0, count, BATCH):
        batch = [AdmitRequest(f"t{i % TENANTS}", f"{prefix}-{i}", 50, 20, '{"b":1}',
                              model="m") for i in range(start, min(start + BATCH, count))]
        await queues.admit_many(batch)
        grants = (await queues.grant("bench", len(batch), max_grants=len(batch))).grants
        final = end_data("stop", 50, 20, 8, TIMINGS)
        calls = [(g.lease, 50, 20, "stop") for g in grants]
        # as complete_many, with a terminal event that holds cached tokens and timings
        args = [a for c in calls
                for a in queues._complete_args(*c, final, RequestState.COMPLETED)]
        await queues.scripts.run(Script.COMPLETE, len(calls), *args)


async def bench(requests: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="fs-usage-bench-") as directory:
        server = EmbeddedRedis(directory).start()
        client = connect(server.url)
        try:
            store = TenantStore(Scripts(client))
            for i in range(TENANTS):
                await store.add(Tenant(id=f"t{i}"))
            modes = {"on": TenantQueues(Scripts(client)),
                     "off": TenantQueues(Scripts(client, usage_retention_days=0))}
            pid = server._process.pid  # type: ignore[union-attr]
            results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
            for r in range(rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    cpu0, t0 = cpu_seconds([pid]), time.perf_counter()
                    await _lifetimes(modes[mode], f"{mode}{r}", requests)
                    wall, cpu = time.perf_counter() - t0, cpu_seconds([pid]) - cpu0
                    results[mode].append((wall / requests * 1e6, cpu / requests * 1e6))
        finally:
            await client.aclose()
            server.stop()
    print(f"usage records on vs off: {requests} request lifetimes x {rounds} rounds, one "
          f"redis-server; CPU: {platform.processor() or platform.machine()}")
    print(f"{'mode':<6}{'wall us/request':>18}{'redis CPU us/request':>24}")
    medians = {}
    for mode, values in results.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        medians[mode] = (wall, cpu)
        print(f"{mode:<6}{wall:>18.1f}{cpu:>24.1f}")
    print(f"{'on/off':<6}{medians['on'][0] / medians['off'][0]:>18.3f}"
          f"{medians['on'][1] / max(medians['off'][1], 1e-9):>24.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(bench(args.requests, args.rounds))


if __name__ == "__main__":
    main()
