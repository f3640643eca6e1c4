"""The Ray nodes as the routers see them: how many are alive, how many were lost (died without
being asked to: a crash, a pod or VM gone, a raylet killed) and how many were removed on
purpose (drained, scaled down), with the lost ones named.

Every router reads Ray's node table (from the GCS) every ``PUBLISH_S`` and writes this summary
to Redis (``keys.nodes()``, JSON of at most ``MAX_LOST_LISTED`` names, expiring after
``TTL_S``), and where it runs itself (``keys.router_node``, as long): ``/metrics`` serves the
summary as ``fairserve_ray_nodes{state}`` and ``fairserve status`` prints both, neither
needing Ray itself. The replicas say where they run in their load reports (``this_node``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from router.state import keys

PUBLISH_S = 2.0
TTL_S = 30
MAX_LOST_LISTED = 16
# Ray's NodeDeathInfo reasons of a node stopped on purpose (src/ray/protobuf/gcs.proto):
# EXPECTED_TERMINATION and AUTOSCALER_DRAIN_IDLE; the others (unspecified, unexpected
# termination, preempted) count as lost
_ON_PURPOSE = {1, 4}


@dataclass(frozen=True, slots=True)
class NodeCounts:
    alive: int = 0
    lost: int = 0
    removed: int = 0
    lost_nodes: tuple[str, ...] = field(default_factory=tuple)  # "<host> <node id>", newest last

    @classmethod
    def of_ray(cls, table: Iterable[Mapping[str, Any]]) -> NodeCounts:
        """From ``ray.nodes()``."""
        alive = lost = removed = 0
        names = []
        for node in table:
            if node.get("Alive"):
                alive += 1
            elif int(node.get("DeathReason") or 0) in _ON_PURPOSE:
                removed += 1
            else:
                lost += 1
                names.append(f"{node.get('NodeManagerHostname', '?')} "
                             f"{str(node.get('NodeID', '?'))[:12]}")
        return cls(alive, lost, removed, tuple(names[-MAX_LOST_LISTED:]))

    def summary(self) -> str:
        text = f"{self.alive} alive, {self.lost} lost, {self.removed} removed"
        return text + (f" (lost: {', '.join(self.lost_nodes)})" if self.lost_nodes else "")


async def publish(client: Any, counts: NodeCounts) -> None:
    await client.set(keys.nodes(), json.dumps(asdict(counts)), ex=TTL_S)


async def read(client: Any) -> NodeCounts | None:
    """The last summary a router wrote; None when no router wrote one lately (no Ray)."""
    raw = await client.get(keys.nodes())
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return NodeCounts(int(data["alive"]), int(data["lost"]), int(data["removed"]),
                          tuple(str(n) for n in data.get("lost_nodes", ())))
    except (ValueError, KeyError, TypeError):
        return None


def this_node() -> str:
    """Where this process runs: the host's name (a pod's name on Kubernetes) and the first
    characters of its Ray node's id (several Ray nodes may share a host)."""
    import ray  # only when asked: the router's state modules do not need Ray

    host = socket.gethostname()
    if not ray.is_initialized():
        return host
    return f"{host}/{ray.get_runtime_context().get_node_id()[:8]}"


async def publish_router(client: Any, holder: str, node: str) -> None:
    await client.set(keys.router_node(holder), node, ex=TTL_S)


async def read_routers(client: Any) -> dict[str, str]:
    """Each live router (its holder id) and where it runs."""
    holders = sorted(m.decode() for m in await client.smembers(keys.metrics_routers()))
    if not holders:
        return {}
    where = await client.mget([keys.router_node(h) for h in holders])
    return {h: w.decode() for h, w in zip(holders, where, strict=True) if w is not None}
