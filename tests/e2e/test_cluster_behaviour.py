"""The whole stack under load: fairness between tenants, clients that hang up, concurrency
across two replicas and two routers."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router.state import keys
from router.state.redis_client import connect
from router.state.tenants import Tenant
from tests.e2e.factories import MODEL, NUM_REPLICAS, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OUTPUT_TOKENS = 8


async def _stats(e2e: E2ECluster, tenant_id: str) -> dict[str, int]:
    client = connect(e2e.redis_url)
    try:
        raw = await client.hgetall(keys.stats(tenant_id))
        return {k.decode(): int(v) for k, v in raw.items()}
    finally:
        await client.aclose()


def test_weights_1_and_3_receive_output_tokens_1_to_3(e2e: E2ECluster) -> None:
    keys_by_tenant = {"fair-a": e2e.add_tenant(Tenant(id="fair-a", weight=1, max_queued=1000)),
                      "fair-b": e2e.add_tenant(Tenant(id="fair-b", weight=3, max_queued=1000))}
    counts = {"fair-a": 60, "fair-b": 180}  # both stay backlogged until b is done
    done: list[tuple[float, str, int]] = []

    async def one(client, tenant: str, i: int) -> None:
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say a word. ({i})"}],
            max_tokens=OUTPUT_TOKENS, temperature=1.0, seed=i,
            extra_body={"min_tokens": OUTPUT_TOKENS})
        done.append((time.monotonic(), tenant, r.usage.completion_tokens))

    async def go() -> None:
        clients = {t: e2e.async_client(k) for t, k in keys_by_tenant.items()}
        try:
            await asyncio.gather(*(one(clients[t], t, i) for t, n in counts.items()
                                   for i in range(n)))
        finally:
            for c in clients.values():
                await c.close()

    asyncio.run(go())
    done.sort()
    b_finished = max(at for at, tenant, _ in done if tenant == "fair-b")
    tokens = {t: sum(n for at, tenant, n in done if tenant == t and at <= b_finished)
              for t in counts}
    share_a = tokens["fair-a"] / (tokens["fair-a"] + tokens["fair-b"])
    print(f"\noutput tokens while both were backlogged: {tokens}, share of a {share_a:.3f} "
          f"(weight share 0.25)")
    assert abs(share_a - 0.25) <= 0.025, tokens
    assert all(n == OUTPUT_TOKENS for _, _, n in done)


def test_clients_that_hang_up_leave_nothing_behind(e2e: E2ECluster) -> None:
    key = e2e.add_tenant(Tenant(id="hangups", max_queued=1000))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True, "extra_body": None}
    body.pop("extra_body")
    seen_content = 0

    async def hang_up(client: httpx.AsyncClient, after_content: bool) -> None:
        nonlocal seen_content
        async with client.stream("POST", f"{e2e.base_url}/chat/completions", json=body,
                                 headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if not after_content or delta.get("content"):
                    seen_content += bool(delta.get("content"))
                    return  # leaving the block closes the connection mid-stream

    async def go() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            # 20 running when they hang up, 10 more that hang up at once (some still queued)
            await asyncio.gather(*(hang_up(client, i < 20) for i in range(30)))

    asyncio.run(go())
    assert seen_content == 20
    leased, loads = asyncio.run(e2e.wait_idle(timeout_s=30))
    assert leased == 0
    assert len(loads) == NUM_REPLICAS
    for load in loads:
        assert load.ongoing == load.num_running == load.num_waiting == 0
        assert load.num_free_kv_blocks == load.num_total_kv_blocks, load
    stats = asyncio.run(_stats(e2e, "hangups"))
    assert stats.get("cancelled", 0) == 30, stats
    assert stats.get("completed", 0) == 0, stats


def test_two_replicas_and_two_routers_serve_concurrent_requests(e2e: E2ECluster) -> None:
    key = e2e.add_tenant(Tenant(id="concurrent", max_queued=1000))

    async def one(client, i: int) -> int:
        if i % 2:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True})
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            assert usage is not None
            return usage.completion_tokens
        r = await client.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=16,
                                            temperature=0)
        return r.usage.completion_tokens

    async def go() -> list[int]:
        client = e2e.async_client(key)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(48)))
        finally:
            await client.close()

    results = asyncio.run(go())
    assert len(results) == 48 and all(1 <= n <= 16 for n in results)
    _, loads, _ = asyncio.run(e2e.redis_state())
    assert len(loads) == NUM_REPLICAS
    assert all(load.output_tokens_per_s > 0 for load in loads), loads  # both replicas served
    stats = asyncio.run(_stats(e2e, "concurrent"))
    assert stats.get("completed") == 48 and not stats.get("dead"), stats
