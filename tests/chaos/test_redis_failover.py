"""The Redis primary lost under 16 streams, with a replica promoted by Sentinel; and the loss
such a failover can cause, made on purpose.

The cluster's ``redis.url`` names Sentinel (``redis+sentinel://``; a primary, 2 replicas and one
Sentinel) and admissions wait for one replica's acknowledgement (``queues.replicas_to_ack: 1``).
Three phases on one cluster, each under 16 streams:

1. **kill**: the primary is killed (kill -9);
2. **freeze**: the new primary is frozen (SIGSTOP) until Sentinel has promoted another replica,
   then thawed: for a moment it takes writes as the old primary that the new one never gets
   (the classic way Redis loses acknowledged writes);
3. **lost appends**: each stream's last chunk, which its client has read, is deleted from
   Redis, with the request's position set back: what a failover to a replica that had not
   received that append leaves (on one machine replication takes microseconds, so phases 1 and
   2 seldom lose one).

Redis replicates asynchronously, so the new primary may lack the last events a replica wrote: the
writer's next chunk then starts past what the stream holds and is refused (a gap: the dispatcher
reads the stream back and has the rest made again), and readers skip tokens their client has.
Goals: the router and the model replica follow the new primary by themselves; every client ends
with the uninterrupted text, no error; every request the cluster acknowledged is completed
(admitted = completed); a request sent while there is no primary is served or refused with 503
and Retry-After, never a 500; in phase 3 each stream's gap is repaired (``stream_gap``
migrations).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest

from cluster.launcher import DEMO_TENANT
from router.state import keys
from router.state.redis_client import connect, sync_connect
from tests.chaos.factories import (
    StreamResult,
    assert_exact,
    metrics_url,
    start,
    stream_chat,
    unstreamed,
    wait_for_tokens,
)
from tests.chaos.test_migration import bodies, references, settings
from tests.redis_ha import Servers, sentinel_servers, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

MAX_TOKENS = 64
PROBE_S = 8.0  # new requests are sent this long after the primary is lost

# What a failover to a replica that had not received a stream's last append leaves: the stream
# without its last chunk, and the request's position for that choice back where it was before
# it. Atomic (one script), as the promotion is.
LOSE_LAST_APPEND = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 or last[1][2][2] ~= 'chunk' then return 0 end
local chunk = cjson.decode(last[1][2][4])
if (chunk.p or 0) == 0 then return 0 end
redis.call('XDEL', KEYS[1], last[1][1])
redis.call('HSET', KEYS[2], 'pos:' .. (chunk.i or 0), chunk.p - chunk.n)
redis.call('HINCRBY', KEYS[2], 'streamed', -chunk.n)
return chunk.p
"""


def short_request() -> dict:
    return {**unstreamed(bodies()[0]), "max_tokens": 4}


async def lose_the_primary(servers: Servers, how: str) -> None:
    primary = servers.by_port[servers.primary_now()]
    if how == "kill":
        os.kill(primary.pid, signal.SIGKILL)
        return
    before = servers.primary_now()
    os.kill(primary.pid, signal.SIGSTOP)
    try:
        await asyncio.to_thread(wait_until, "a promotion",
                                lambda: servers.primary_now() != before)
    finally:
        os.kill(primary.pid, signal.SIGCONT)


async def lose_last_appends(servers: Servers, results: list[StreamResult]) -> None:
    redis = connect(servers.url)
    try:
        for result in results:  # every client has read the chunk its stream now loses
            assert result.request_id is not None
            await redis.eval(LOSE_LAST_APPEND, 2, keys.stream(DEMO_TENANT, result.request_id),
                             keys.request(DEMO_TENANT, result.request_id))
    finally:
        await redis.aclose()


async def phase(base: str, key: str, servers: Servers, how: str
                ) -> tuple[list[StreamResult], list[httpx.Response], float]:
    """16 streams; the primary lost (or appends lost) once each has text; requests sent while
    it fails over; until every stream ends."""
    results = [StreamResult() for _ in bodies()]
    probes: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies(MAX_TOKENS), results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        lost = time.monotonic()
        if how == "lost appends":
            await lose_last_appends(servers, results)
        else:
            await lose_the_primary(servers, how)
            while time.monotonic() - lost < PROBE_S:
                probes.append(await client.post(f"{base}/chat/completions",
                                                json=short_request(), timeout=120,
                                                headers={"Authorization": f"Bearer {key}"}))
                await asyncio.sleep(0.3)
        await asyncio.gather(*tasks)
        took_s = time.monotonic() - lost
    return results, probes, took_s


def _migrations(up) -> dict[str, float]:
    text = httpx.get(metrics_url(up), timeout=30).text
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("fairserve_migrations_total")}


def test_redis_failovers_under_streams_break_none_and_lose_no_admission(tmp_path) -> None:
    with sentinel_servers(tmp_path / "redis", num_replicas=2) as servers:
        config = settings(1)
        config["redis"] = {"url": servers.url}
        config["queues"] = {"replicas_to_ack": 1, "ack_timeout_ms": 1000, "lease_ms": 3000}
        config["router"]["dispatch"]["renew_s"] = 1.0  # a third of the lease, at most
        up, base, key, _ = start(tmp_path, config)
        try:
            expected = asyncio.run(references(base, key, MAX_TOKENS))
            for how in ("kill", "freeze", "lost appends"):
                # the last failover has settled: the primary has a replica to acknowledge
                # admissions (queues.replicas_to_ack), or every new stream is a 503
                wait_until("a replica online", lambda: servers.replicas_online() >= 1, 60)
                before = servers.primary_now()
                gaps_before = _migrations(up).get("stream_gap", 0)
                results, probes, took_s = asyncio.run(phase(base, key, servers, how))
                assert_exact(results, expected, MAX_TOKENS)
                # a new client asks Sentinel (one connected before would stay on a demoted
                # primary for commands a replica answers too)
                redis = sync_connect(servers.url, socket_timeout=5)
                if how != "lost appends":  # a replica was promoted, and everyone follows it
                    assert servers.primary_now() != before
                    assert int(redis.info("server")["tcp_port"]) == servers.primary_now()
                # every request the cluster acknowledged is completed
                admitted = [r.request_id for r in results]
                for response in probes:
                    assert response.status_code in (200, 503), response.text
                    if response.status_code == 503:
                        assert int(response.headers["retry-after"]) >= 1
                    else:
                        admitted.append(response.headers["x-fairserve-request-id"])

                def all_completed(ids: list[str | None] = admitted,
                                  redis: Any = redis) -> bool:
                    return all(redis.hget(keys.request(DEMO_TENANT, rid), "state")
                               == b"completed" for rid in ids)

                # a completion the frozen primary took and lost leaves its request leased:
                # once the lease runs out it is served again (nobody reads it) and completed
                wait_until(f"{how}: every admitted request completed", all_completed,
                           timeout_s=120)
                migrations = _migrations(up)
                if how == "lost appends":  # each stream's gap repaired by a migration
                    assert migrations.get("stream_gap", 0) - gaps_before >= len(results)
                print(f"\n{how}: 16 streams exact {took_s:.1f} s after; probes {len(probes)}: "
                      f"{sum(p.status_code == 200 for p in probes)} served, "
                      f"{sum(p.status_code == 503 for p in probes)} refused (503); "
                      f"admitted {len(admitted)} = completed; migrations so far {migrations}")
        finally:
            up.stop()
