"""Crash probe of the tenant queues: admit as fast as one client can, kill -9 the
redis-server mid-stream, restart it on the same data directory, and count the acknowledged
admissions that did not survive.

    python -m cluster.benchmarks.durability [--trials 5] [--kill-after-s 1.0]

prints, per ``appendfsync`` policy, the acknowledged admissions and how many were lost. The
chaos tests assert zero loss with ``always``; with ``everysec`` the table is the measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import redis

from cluster.redis_server import AppendFsync, EmbeddedRedis
from router.messages import AdmitRequest
from router.state import keys
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore

TENANT_ID = "probe"


@dataclass(frozen=True, slots=True)
class CrashTrial:
    num_acknowledged: int
    num_lost: int
    is_order_kept: bool  # the survivors are the acknowledged ids, in order, as a prefix or all


async def _admit_until_killed(url: str) -> list[str]:
    client = connect(url, socket_timeout=5)
    queues = TenantQueues(Scripts(client))
    acknowledged: list[str] = []
    try:
        await TenantStore(queues.scripts).put(Tenant(id=TENANT_ID, max_queued=10_000_000))
        while True:
            rid = f"r{len(acknowledged)}"
            await queues.admit(AdmitRequest(TENANT_ID, rid, 10, 10, '{"probe": true}'))
            acknowledged.append(rid)
    except (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError):
        return acknowledged
    finally:
        await client.aclose(close_connection_pool=True)


def crash_trial(data_dir: Path, appendfsync: AppendFsync, kill_after_s: float) -> CrashTrial:
    """One kill -9 mid-stream and a restart on the same directory and port."""
    server = EmbeddedRedis(data_dir, appendfsync=appendfsync).start()
    killer = threading.Timer(kill_after_s, server.kill)
    killer.start()
    acknowledged = asyncio.run(_admit_until_killed(server.url))
    killer.join()
    restarted = EmbeddedRedis(data_dir, port=server.port, appendfsync=appendfsync).start()
    try:
        client = restarted.client()
        queued = cast(list[bytes], client.lrange(keys.queue(TENANT_ID), 0, -1))
        survivors = [m.decode() for m in queued]
        client.close()
    finally:
        restarted.stop()
    lost = len(set(acknowledged) - set(survivors))
    kept = survivors[: len(acknowledged)] == acknowledged[: len(survivors)]
    return CrashTrial(len(acknowledged), lost, kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--kill-after-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    print(f"{'appendfsync':<12} {'trials':>6} {'acked (median)':>15} {'lost (total)':>13} "
          f"{'lost (max)':>11} {'order kept':>11}")
    for policy in (AppendFsync.ALWAYS, AppendFsync.EVERYSEC):
        trials = []
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory() as tmp:
                trials.append(crash_trial(Path(tmp), policy, args.kill_after_s))
        print(f"{policy.value:<12} {len(trials):>6} "
              f"{statistics.median(t.num_acknowledged for t in trials):>15.0f} "
              f"{sum(t.num_lost for t in trials):>13} {max(t.num_lost for t in trials):>11} "
              f"{str(all(t.is_order_kept for t in trials)):>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
