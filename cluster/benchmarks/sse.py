"""What the cluster benchmarks share: the events of one streamed OpenAI request, percentiles."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


async def sse_events(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                     headers: dict[str, str], label: str = "") -> AsyncIterator[dict[str, Any]]:
    """The JSON events of one streamed request, ``[DONE]`` left out; an error status or an
    error event raises, prefixed with ``label``."""
    async with http.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{label}{response.status_code} {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{label}{event['error']}")
            yield event


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]
