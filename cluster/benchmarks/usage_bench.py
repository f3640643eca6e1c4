"""What the usage records cost: request lifetimes on one redis-server with them on and off.

    python -m cluster.benchmarks.usage_bench [--requests 3000] [--rounds 5]
    python -m cluster.benchmarks.usage_bench --cluster [--rounds 3]

A lifetime is what the queue scripts do for one served request: admitted (pipelined 32 deep),
granted (32 per grant call) and completed with its terminal event (one pipeline per 32). With
usage records on, ``admit.lua`` and ``complete.lua`` also write the tenant's hourly record (no
extra round trip). Each round runs both, in alternating order, on fresh keys; the table gives
the median wall time and redis-server CPU per request of each, and their ratio. No model and
no cluster: this is the part of the serving path the records touch.

``--cluster``: ``make bench-cluster``'s workload (32 streams of 100 prompt tokens -> 64 output
tokens, one replica, the real engine) through the whole cluster, with usage records on and
off; the setting is read when the cluster starts, so each run starts a cluster of its own, the
two alternating in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from cluster.benchmarks.peer_bench import cpu_name
from cluster.benchmarks.serving_path import cpu_seconds
from cluster.redis_server import EmbeddedRedis
from router.dispatch.response_events import end_data
from router.messages import AdmitRequest
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
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
        # a terminal event that holds cached tokens and timings, as a served request's does
        await queues.complete_many([(g.lease, 50, 20, "stop") for g in grants],
                                   end_data("stop", 50, 20, 8, TIMINGS))


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
          f"redis-server; CPU: {cpu_name()}")
    print(f"{'mode':<6}{'wall us/request':>18}{'redis CPU us/request':>24}")
    medians = {}
    for mode, values in results.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        medians[mode] = (wall, cpu)
        print(f"{mode:<6}{wall:>18.1f}{cpu:>24.1f}")
    print(f"{'on/off':<6}{medians['on'][0] / medians['off'][0]:>18.3f}"
          f"{medians['on'][1] / max(medians['off'][1], 1e-9):>24.3f}")


def cluster_run(retention_days: int, seed: int) -> float:
    """Output tokens per second of bench-cluster's 32 streams on a fresh cluster."""
    import openai

    from cluster.benchmarks.cluster_bench import bench_settings, run_cluster
    from cluster.benchmarks.engine_bench import make_prompts
    from cluster.launcher import LocalCluster, add_tenant_with_key
    from replicas.torch_engine.loader import load_model_source

    with tempfile.TemporaryDirectory(prefix="fs-usage-cluster-") as state_dir:
        base = bench_settings(state_dir, 2, 32)
        settings = base.model_copy(update={"queues": base.queues.model_copy(
            update={"usage_retention_days": retention_days})})
        tokenizer = load_model_source(settings.engine.model).tokenizer
        cluster = LocalCluster(settings)
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="bench", max_queued=10_000))

            async def drive() -> float:
                client = openai.AsyncOpenAI(base_url=info.base_url, api_key=key,
                                            max_retries=0, timeout=600)
                try:
                    model = settings.engine.served_model_name
                    await run_cluster(client, model, make_prompts(tokenizer, 2, 100, seed=0), 2,
                                      4)  # warm-up
                    run = await run_cluster(client, model,
                                            make_prompts(tokenizer, 32, 100, seed=seed), 32, 64)
                    return run.tokens_per_s
                finally:
                    await client.close()

            return asyncio.run(drive())
        finally:
            cluster.stop()


def bench_cluster(rounds: int) -> None:
    results: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            results[mode].append(cluster_run(35 if mode == "on" else 0, seed=r + 1))
            print(f"round {r + 1} {mode}: {results[mode][-1]:.1f} tok/s", flush=True)
    print(f"usage records on vs off through the cluster: 32 streams x 100 -> 64 tokens, one "
          f"replica, {rounds} rounds; CPU: {cpu_name()}")
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"{'mode':<6}{'median tok/s':>14}{'runs':>40}")
    for mode, values in results.items():
        print(f"{mode:<6}{statistics.median(values):>14.1f}    "
              f"{', '.join(f'{v:.1f}' for v in values)}")
    print(f"on/off {on / off:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cluster", action="store_true",
                        help="through the whole cluster (bench-cluster's workload)")
    args = parser.parse_args()
    if args.cluster:
        bench_cluster(args.rounds)
    else:
        asyncio.run(bench(args.requests, args.rounds))


if __name__ == "__main__":
    main()
