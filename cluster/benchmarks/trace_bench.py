"""The throughput cost of tracing: the cluster benchmark's workload, traced and untraced, in one
run on one cluster.

    python -m cluster.benchmarks.trace_bench [--requests 32] [--prompt-tokens 100] [--output-tokens 64]
                                  [--concurrency 1 32] [--repeats 3] [--threads 2]

The cluster (one replica, one router, as ``cluster.benchmarks.cluster_bench``) runs with tracing on, exporting
over OTLP/HTTP to a receiver in this process that decodes every span. Runs alternate:
*traced* requests carry no ``traceparent``, so each is a new, sampled trace (full sampling:
server, queue, dispatch, engine queue, prefill and decode spans, all exported); *untraced*
requests carry a client ``traceparent`` whose sampled flag is off, which the parent-based
sampler honours end to end: no span is recorded or exported. What differs between the two is
therefore exactly the cost of recording and exporting the spans. The table shows the median run
of each and the spans the receiver got per traced request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import tempfile

import openai

from cluster.benchmarks.cluster_bench import (
    Run,
    add_workload_args,
    bench_settings,
    median_run,
    run_cluster,
)
from cluster.benchmarks.engine_bench import make_prompts
from cluster.benchmarks.otlp_receiver import OtlpReceiver
from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.settings import load_settings
from replicas.torch_engine.loader import load_model_source
from router.state.tenants import Tenant


def unsampled() -> dict[str, str]:
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"}


async def measure(args: argparse.Namespace, base_url: str, key: str, model: str,
                  receiver: OtlpReceiver) -> list[tuple[Run, Run, float]]:
    tokenizer = load_model_source(load_settings().engine.model).tokenizer
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    seed = 1
    out = []
    try:
        warm = make_prompts(tokenizer, 2, args.prompt_tokens, seed=0)
        await run_cluster(client, model, warm, 2, 4)
        for c in args.concurrency:
            plain, traced, spans_per_request = [], [], []
            for _ in range(args.repeats):
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens, seed=seed)
                plain.append(await run_cluster(client, model, prompts, c, args.output_tokens,
                                               unsampled, "untraced"))
                before = len(receiver.snapshot())
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens,
                                       seed=seed + 1)
                seed += 2
                traced.append(await run_cluster(client, model, prompts, c, args.output_tokens,
                                                system="traced"))
                await asyncio.sleep(6)  # the batch processors' 5 s export delay
                spans_per_request.append((len(receiver.snapshot()) - before) / args.requests)
                print(f"concurrency {c}: untraced {plain[-1].tokens_per_s:.1f} tok/s, traced "
                      f"{traced[-1].tokens_per_s:.1f} tok/s, {spans_per_request[-1]:.1f} spans "
                      "per traced request", flush=True)
            out.append((median_run(plain), median_run(traced),
                        sorted(spans_per_request)[len(spans_per_request) // 2]))
        return out
    finally:
        await client.close()


def print_table(rows: list[tuple[Run, Run, float]]) -> None:
    header = (f"{'concurrency':>11} | {'tracing':<8} | {'out tok/s':>9} | {'vs untraced':>11} | "
              f"{'TTFT p50 ms':>11} | {'spans/request':>13}")
    print(header)
    print("-" * len(header))
    for plain, traced, spans in rows:
        print(f"{plain.concurrency:>11} | {'off':<8} | {plain.tokens_per_s:>9.1f} | "
              f"{'':>11} | {plain.ttft_ms(0.5):>11.1f} | {0:>13}")
        ratio = f"{traced.tokens_per_s / plain.tokens_per_s:.1%}"
        print(f"{traced.concurrency:>11} | {'on':<8} | {traced.tokens_per_s:>9.1f} | "
              f"{ratio:>11} | {traced.ttft_ms(0.5):>11.1f} | {spans:>13.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser)
    args = parser.parse_args()
    slots = max(args.concurrency)
    receiver = OtlpReceiver()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    with tempfile.TemporaryDirectory(prefix="fairserve-trace-bench-") as state_dir:
        settings = bench_settings(state_dir, args.threads, slots)
        cluster = LocalCluster(settings, progress=lambda line: print(line, flush=True))
        try:
            info = cluster.start()
            key = add_tenant_with_key(info.redis_url, Tenant(id="bench", max_queued=10_000))
            rows = asyncio.run(measure(args, info.base_url, key,
                                       settings.engine.served_model_name, receiver))
        finally:
            cluster.stop()
            receiver.stop()
    print()
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens -> "
          f"{args.output_tokens} output tokens, {args.threads} torch threads, median of "
          f"{args.repeats} runs; tracing on in the cluster, OTLP/HTTP to a local receiver; "
          "'off' = requests with an unsampled client traceparent")
    print_table(rows)


if __name__ == "__main__":
    main()
