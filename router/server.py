"""The router as a Ray Serve ingress deployment, and the dispatcher's way to the replicas.

``RouterServer`` holds one ``RouterService`` (Redis client, dispatcher loop) and serves the
FastAPI app of ``router/api/routes.py``, built after the constructor (``__serve_build_asgi_app__``).
``ServeReplicaPool`` calls the model deployment through a streaming handle and turns Ray's
failures into the router's: a replica that died or cannot be reached is
``ReplicaUnavailableError`` (the dispatcher requeues), an exception raised by the replica's own
code is ``ReplicaFailedError``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray.exceptions
from ray import serve
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
    RequestCancelledError,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from replicas.protocol import CallReport, ModelInfo, ReplicaCall
from router.api.routes import build_api
from router.config import ApiSettings, QueueSettings
from router.dispatch.dispatcher import DispatchSettings
from router.errors import ReplicaFailedError, ReplicaUnavailableError
from router.service import RouterOptions, RouterService, ServedModel
from router.state import nodes
from router.state.redis_client import connect, with_env_password
from router.telemetry.tracing import configure_tracing

logger = logging.getLogger(__name__)

# connections of one router: commands are short (blocking reads share one connection)
REDIS_POOL_SIZE = 64

_UNAVAILABLE = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.RayActorError, DeploymentUnavailableError, BackPressureError)


class _ReplicaStream:
    def __init__(self, response: DeploymentResponseGenerator) -> None:
        self.response = response

    def cancel(self) -> None:
        self.response.cancel()

    async def __aiter__(self) -> AsyncIterator[CallReport]:
        try:
            async for wire in self.response:
                yield CallReport.decode(wire)
        except RequestCancelledError:
            return
        except _UNAVAILABLE as exc:
            raise ReplicaUnavailableError(f"replica unavailable: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise ReplicaFailedError(f"the replica failed the request: {cause}") from exc
        except RayServeException as exc:
            raise ReplicaUnavailableError(f"replica unavailable: {exc}") from exc


class ServeReplicaPool:
    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle.options(stream=True)

    def generate(self, call: ReplicaCall) -> _ReplicaStream:
        response = self.handle.generate.remote(call)
        assert isinstance(response, DeploymentResponseGenerator), "the handle streams"
        return _ReplicaStream(response)


@dataclass(frozen=True, slots=True)
class RoutedModel:
    """A base model as the router deployment is given it: what it knows of the model, its
    replica deployment (Ray Serve hands the router a handle in its place), its pool and its
    aliases."""

    info: ModelInfo
    replicas: Any  # the bound deployment; a DeploymentHandle in the router
    pool: str = ""
    aliases: tuple[str, ...] = ()


@serve.ingress()
class RouterServer:
    async def __init__(self, models: list[RoutedModel], redis_url: str,  # type: ignore[misc]  # Ray Serve awaits it
                       api: ApiSettings, queues: QueueSettings,
                       dispatch: DispatchSettings) -> None:
        try:
            holder = f"router-{serve.get_replica_context().replica_id.unique_id}"
        except RayServeException:
            holder = f"router-{uuid.uuid4().hex[:12]}"
        client = connect(with_env_password(redis_url), max_connections=REDIS_POOL_SIZE, socket_timeout=10,
                         health_check_interval=30)
        tracing = configure_tracing("fairserve-router")
        served = [ServedModel(m.info, ServeReplicaPool(m.replicas), m.pool, m.aliases)
                  for m in models]
        self.service = RouterService(client, served, holder,
                                     RouterOptions(api, queues, dispatch, tracing))
        await self.service.start()
        self._nodes = asyncio.create_task(_publish_nodes(client, holder), name="ray nodes")
        logger.info("router %s ready", holder)

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self.service)

    async def __del__(self) -> None:
        self._nodes.cancel()
        await self.service.stop()
        self.service.tracing.shutdown()  # flushes the spans not exported yet


async def _publish_nodes(client: Any, holder: str) -> None:
    """Ray's nodes (alive, lost, removed) and where this router runs into Redis every
    ``nodes.PUBLISH_S``, for ``/metrics`` and ``fairserve status`` (``router/state/nodes.py``)."""
    here = nodes.this_node()
    failing = ""  # the last failure, logged once until it changes or the next round works
    while True:
        try:
            await nodes.publish_router(client, holder, here)
            table = await asyncio.to_thread(ray.nodes)
            await nodes.publish(client, nodes.NodeCounts.of_ray(table))
            failing = ""
        except Exception as exc:  # noqa: BLE001 - Redis or the GCS away: the next round
            if str(exc) != failing:
                failing = str(exc)
                logger.warning("publishing Ray's nodes failed (status and /metrics go without "
                               "them until it works): %s", exc)
        await asyncio.sleep(nodes.PUBLISH_S)
