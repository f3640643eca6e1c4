"""Whether the Serve application fits the Ray cluster, checked before anything is deployed;
and the model replicas' CPU share when the settings leave it to the machine.

NOTE: Ray Serve never refuses a deployment it cannot place: its replicas wait in
PENDING_ALLOCATION for resources that may never come, and ``serve.run`` waits with them, so a
configuration that asks two 1-CPU replicas and a router of a 2-CPU machine hangs without a word.
So the launcher asks first. Everything the application may ever hold at once is added up: every
model replica (``max_replicas`` under autoscaling, since a scale-out must be placeable too) and
every router, per resource (CPU, GPU). On a local Ray that the launcher started, a shortfall is
a ``PlacementError`` naming the numbers asked and available. On a Ray cluster that was joined,
it is only a warning: that cluster may autoscale, and may hold resources of an older version of
this application that the new one replaces.

``replicas.num_cpus`` unset means "fit the machine": the CPUs left after the routers, shared by
the replicas the application may hold (at most 1 CPU each).

``engine.num_threads`` unset on a local Ray means the same share in whole cores (rounded, at
least 1): Ray's reservation is bookkeeping, but a worker's torch otherwise takes Ray's
OMP_NUM_THREADS, i.e. the reservation rounded down, so `make up`'s one replica on 2 cores computed
on 1 and left the other to a router that needs a tenth of one (measured: 32 streams through the
cluster 171 -> 275 tok/s, the engine alone 302). On a joined Ray the nodes are not this machine
and the threads stay Ray's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from cluster.errors import PlacementError
from cluster.settings import FairserveSettings, ReplicaSettings

logger = logging.getLogger(__name__)

MAX_AUTO_REPLICA_CPUS = 1.0
MIN_AUTO_REPLICA_CPUS = 0.01  # Ray refuses a zero request only for GPUs; keep a real share
EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class RayResources:
    """What the Ray cluster has free: in all, and on its largest node (one actor's ceiling)."""

    num_cpus: float
    num_gpus: float
    largest_node_cpus: float
    largest_node_gpus: float
    is_local: bool  # started by this launcher (its whole size is ours)

    @classmethod
    def of_ray(cls, is_local: bool) -> RayResources:
        import ray

        available = ray.available_resources()
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        return cls(
            num_cpus=float(available.get("CPU", 0.0)),
            num_gpus=float(available.get("GPU", 0.0)),
            largest_node_cpus=max((float(n.get("CPU", 0.0)) for n in nodes), default=0.0),
            largest_node_gpus=max((float(n.get("GPU", 0.0)) for n in nodes), default=0.0),
            is_local=is_local,
        )


def max_model_replicas(settings: FairserveSettings) -> int:
    """The most model replicas the application may hold at once (all its models')."""
    return sum(_max_replicas(m.replicas) for m in settings.served_models())


def _max_replicas(replicas: ReplicaSettings) -> int:
    scaling = replicas.autoscaling
    return replicas.num_replicas if scaling is None else scaling.max_replicas


def place(settings: FairserveSettings, resources: RayResources) -> FairserveSettings:
    """``settings`` with ``replicas.num_cpus`` (and on a local Ray ``engine.num_threads``)
    decided, once checked against ``resources``.

    Raises ``PlacementError`` (local Ray) or logs a warning (joined Ray) when the application
    does not fit; the message names what is asked and what is there.
    """
    settings = _with_engine_threads(_with_replica_cpus(settings, resources), resources)
    problems = _shortfalls(settings, resources)
    if not problems:
        return settings
    where = ("this machine's local Ray" if resources.is_local
             else f"the Ray cluster at {settings.ray.address}")
    message = (f"cannot place the application on {where}: " + "; ".join(problems) +
               ". Lower replicas.num_replicas (or autoscaling.max_replicas), replicas.num_cpus "
               "or router.num_cpus, or leave replicas.num_cpus unset to share the CPUs there are")
    if resources.is_local:
        raise PlacementError(message)
    logger.warning("%s; waiting for that cluster to provide them", message)
    return settings


def _with_replica_cpus(settings: FairserveSettings, resources: RayResources) -> FairserveSettings:
    """Each model whose replicas' CPUs are unset gets an equal share of what the routers
    and the models with CPUs set leave."""
    served = settings.served_models()
    unset = [m for m in served if m.replicas.num_cpus is None]
    if not unset:
        return settings
    left = (resources.num_cpus - settings.router.num_replicas * settings.router.num_cpus
            - sum(_max_replicas(m.replicas) * (m.replicas.num_cpus or 0) for m in served))
    share = left / max(sum(_max_replicas(m.replicas) for m in unset), 1)
    # two decimals, rounded down: the shares must still add up to no more than what is left
    cpus = max(MIN_AUTO_REPLICA_CPUS, min(MAX_AUTO_REPLICA_CPUS, math.floor(share * 100) / 100))
    return settings.with_served([m if m.replicas.num_cpus is not None else replace(
        m, replicas=m.replicas.model_copy(update={"num_cpus": cpus})) for m in served])


def _with_engine_threads(settings: FairserveSettings, resources: RayResources) -> FairserveSettings:
    served = settings.served_models()
    if not resources.is_local or all(m.engine.num_threads is not None for m in served):
        return settings
    left = resources.num_cpus - settings.router.num_replicas * settings.router.num_cpus
    threads = max(1, round(left / max(max_model_replicas(settings), 1)))
    return settings.with_served([m if m.engine.num_threads is not None else replace(
        m, engine=m.engine.model_copy(update={"num_threads": threads})) for m in served])


def _shortfalls(settings: FairserveSettings, resources: RayResources) -> list[str]:
    ro, served = settings.router, settings.served_models()
    counted, cpus, gpus = [], 0.0, 0.0
    for m in served:
        r = m.replicas
        assert r.num_cpus is not None, "replica CPUs are decided before the check"
        n = _max_replicas(r)
        counted.append(f"{n} {'model' if len(served) == 1 else repr(m.name)} replica(s)"
                       + (" (autoscaling.max_replicas)" if r.autoscaling is not None else "")
                       + f" x {r.num_cpus:g} CPU")
        cpus, gpus = cpus + n * r.num_cpus, gpus + n * r.num_gpus
    problems: list[str] = []
    cpus_asked = cpus + ro.num_replicas * ro.num_cpus
    if cpus_asked > resources.num_cpus + EPSILON:
        problems.append(
            f"{' + '.join(counted)} + {ro.num_replicas} router(s) x {ro.num_cpus:g} "
            f"CPU = {cpus_asked:g} CPU asked, {resources.num_cpus:g} CPU available")
    largest_replica = max(m.replicas.num_cpus or 0.0 for m in served)
    for what, asked in (("model replica", largest_replica), ("router", ro.num_cpus)):
        if asked > resources.largest_node_cpus + EPSILON:
            problems.append(f"one {what} asks {asked:g} CPU, the largest node has "
                            f"{resources.largest_node_cpus:g}")
    largest_gpus = max(m.replicas.num_gpus for m in served)
    if gpus > resources.num_gpus + EPSILON:
        problems.append(f"{max_model_replicas(settings)} model replica(s): {gpus:g} GPU asked, "
                        f"{resources.num_gpus:g} GPU available")
    elif largest_gpus > resources.largest_node_gpus + EPSILON:
        problems.append(f"one model replica asks {largest_gpus:g} GPU, the largest node has "
                        f"{resources.largest_node_gpus:g}")
    return problems
