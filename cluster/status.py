"""``fairserve status``: readiness, Redis's role, replicas (from their load reports) and tenants'
queues."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from router.state import keys, nodes
from router.state.capacity import read_loads
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import TenantStore
from router.telemetry.metrics import autoscaler_state


def fetch_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (urllib.error.URLError, OSError) as exc:
        return 0, {"error": str(exc)}


def redis_role(replication: dict[str, Any]) -> str:
    """One line from ``INFO replication``: the server's role and its replicas (or primary)."""
    if replication.get("role") != "master":
        return (f"replica of {replication.get('master_host')}:{replication.get('master_port')} "
                f"(link {replication.get('master_link_status')})")
    replicas = [replication[f"slave{i}"] for i in range(int(replication["connected_slaves"]))]
    listed = ", ".join(f"{r['ip']}:{r['port']} {r['state']}, lag {r['lag']} s" for r in replicas)
    return f"primary, {len(replicas)} replica(s){': ' + listed if listed else ''}"


async def print_status(base_url: str, redis_url: str) -> int:
    code, ready = fetch_json(base_url.removesuffix("/v1") + "/ready")
    print(f"{base_url}: {'ready' if code == 200 else 'NOT READY'} {json.dumps(ready)}")
    client = connect(redis_url, socket_timeout=5)
    try:
        print(f"redis: {redis_role(await client.info('replication'))}")
        loads = await read_loads(client)
        ray_nodes = await nodes.read(client)
        print(f"ray nodes: {ray_nodes.summary() if ray_nodes else 'not reported (no router)'}")
        routers = await nodes.read_routers(client)
        print(f"routers: {len(routers)}" + "".join(f"\n  {holder:<30}{where}"
                                                  for holder, where in routers.items()))
        on = sorted({load.node for load in loads if load.node})
        print(f"\nreplicas: {len(loads)} on {len(on)} node(s)")
        print(f"  {'replica':<14}{'slots':>6}{'ongoing':>8}{'running':>8}{'waiting':>8}"
              f"{'KV used':>9}{'tok/s':>8}  {'node':<28}engine")
        models = sorted({load.model for load in loads})
        if len(models) > 1:
            print("models: " + ", ".join(
                f"{m} ({sum(1 for load in loads if load.model == m)} replica(s))"
                for m in models))
        for load in sorted(loads, key=lambda x: (x.model, x.replica_id)):
            used = load.num_total_kv_blocks - load.num_free_kv_blocks
            print(f"  {load.replica_id:<14}{load.max_ongoing:>6}{load.ongoing:>8}"
                  f"{load.num_running:>8}{load.num_waiting:>8}"
                  f"{used:>4}/{load.num_total_kv_blocks:<4}{load.output_tokens_per_s:>8.1f}"
                  f"  {load.node or '?':<28}{load.compute}"
                  + (f"  model: {load.model}" if len(models) > 1 else "")
                  + (f"  adapters: {', '.join(load.adapters)}" if load.adapters else ""))
        decision, counts = await autoscaler_state(client)
        if decision is not None:
            print(f"autoscaler: target {decision['decision_replicas']} replicas "
                  f"({decision['decision_reason']}); queued {decision['queued_tokens']} tokens "
                  f"in {decision['queued_requests']} requests, in flight "
                  f"{decision['in_flight_tokens']:.0f} tokens, "
                  f"{decision['decision_tokens_per_s']:.1f} tokens/s per replica; decisions "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        tenants = await TenantStore(Scripts(client)).all()
        backlog = {b.tenant_id: b for b in await TenantQueues(Scripts(client)).backlog()}
        leased = sum(b.num_leased for b in backlog.values())  # every model's
        print(f"\ntenants: {len(tenants)}   running (leased): {leased}")
        print(f"  {'tenant':<20}{'weight':>7}{'prio':>5}{'queued':>8}{'completed':>10}"
              f"{'out tokens':>11}")
        for tenant in tenants:
            depth = backlog[tenant.id].num_queued if tenant.id in backlog else 0
            raw: dict[bytes, bytes] = await client.hgetall(keys.stats(tenant.id))  # type: ignore[misc,assignment]
            stats = {k.decode(): v.decode() for k, v in raw.items()}
            print(f"  {tenant.id:<20}{tenant.weight:>7g}{tenant.priority:>5}{depth:>8}"
                  f"{stats.get('completed', '0'):>10}{stats.get('output_tokens', '0'):>11}")
    finally:
        await client.aclose()
    return 0 if code == 200 else 1
