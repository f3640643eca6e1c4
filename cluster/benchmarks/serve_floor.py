"""The latency floor of the cluster's shape: the same two Ray Serve hops a request takes (HTTP
proxy → ingress replica, then a streaming handle call to a second deployment), with no work
at either end. ``cluster.benchmarks.cluster_bench`` runs it beside the cluster so the table shows how much of the
added time-to-first-token Ray Serve itself costs on the machine at hand.

The ingress answers ``POST /`` with an SSE stream whose first event is the first item the
backend yields; the backend yields one item at once. Deployed as its own application under
``ROUTE_PREFIX`` next to the fairserve app, with tiny CPU shares.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

APP_NAME = "serve-floor"
ROUTE_PREFIX = "/_floor"

_api = FastAPI()


class FloorBackend:
    async def generate(self, _: dict[str, int]) -> AsyncIterator[str]:
        yield "token"


@serve.ingress(_api)
class FloorIngress:
    def __init__(self, backend: DeploymentHandle) -> None:
        self.backend = backend.options(stream=True)

    @_api.post("/")
    async def stream(self) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            response = self.backend.generate.remote({})
            assert isinstance(response, DeploymentResponseGenerator), "the handle streams"
            async for item in response:
                yield f"data: {item}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def deploy() -> None:
    tiny = {"num_cpus": 0.01}
    backend = serve.deployment(FloorBackend, ray_actor_options=tiny,
                               max_ongoing_requests=64).bind()  # type: ignore[attr-defined]
    ingress = serve.deployment(FloorIngress, ray_actor_options=tiny,
                               max_ongoing_requests=64).bind(backend)  # type: ignore[attr-defined]
    serve.run(ingress, name=APP_NAME, route_prefix=ROUTE_PREFIX)


def remove() -> None:
    serve.delete(APP_NAME)


async def first_event_s(client: httpx.AsyncClient, http_root: str, requests: int) -> list[float]:
    """Seconds from sending to the first SSE event, one request at a time."""
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        async with client.stream("POST", f"{http_root}{ROUTE_PREFIX}/") as response:
            response.raise_for_status()
            first_s = None
            async for line in response.aiter_lines():  # read to [DONE]
                if first_s is None and line.startswith("data: "):
                    first_s = time.perf_counter() - start
            assert first_s is not None, "the floor stream sent no event"
            times.append(first_s)
    return times
