"""A real cluster for chaos tests, in its own process (``fairserve up``, as a user runs it), and
ways to hurt it: find its Ray worker processes by their titles, kill or freeze them; stream
requests and keep what each client saw, event by event."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from router.state import keys
from router.state.capacity import read_loads
from router.state.redis_client import connect
from tests.cluster.factories import UpProcess

MODEL = "SmolLM2-135M-Instruct"
REPLICA_TITLE = "ServeReplica:fairserve:ModelReplica"
ROUTER_TITLE = "ServeReplica:fairserve:Router"


def start(tmp_path: Path, settings: dict[str, Any]) -> tuple[UpProcess, str, str, str]:
    """``fairserve up`` with ``settings`` (YAML); its process, base URL, key and Redis URL."""
    config = tmp_path / "fairserve.yaml"
    config.write_text(yaml.safe_dump(settings))
    up = UpProcess(tmp_path, "--config", str(config))
    out = up.wait_ready()
    if "API key:" not in out:
        up.kill()
        raise AssertionError(f"fairserve up did not serve:\n{out}")
    run = json.loads((tmp_path / "run.json").read_text())
    key = (tmp_path / "demo-key").read_text().strip()
    return up, run["base_url"], key, run["redis_url"]


def metrics_url(up: UpProcess) -> str:
    """Where the cluster of ``fairserve up`` serves ``/metrics`` (its run state says)."""
    return json.loads((up.state_dir / "run.json").read_text())["metrics_url"]


def pids_titled(title: str, under: int | None) -> list[int]:
    """Processes whose command line (Ray's process title) contains ``title`` and that descend
    from process ``under`` (the test's ``fairserve up``: its Ray and Redis are its children),
    so another cluster on the machine (the e2e suite's, a developer's) is never touched;
    ``None``: any process (for a title that is unique by itself, such as a port)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title in cmdline and (under is None or _descends_from(int(entry.name), under)):
            found.append(int(entry.name))
    return sorted(found)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:  # the parent is the 2nd field after the command name, which may hold spaces
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(pid, sig)


@dataclass
class StreamResult:
    """What one streaming client saw."""

    text: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    event_ids: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    num_done: int = 0
    status: int = 0
    request_id: str | None = None


async def stream_chat(client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any],
                      result: StreamResult, headers: dict[str, str] | None = None) -> None:
    """One streamed chat completion, every event kept (text, ids, errors, the end)."""
    async with client.stream("POST", f"{base}/chat/completions", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {key}", **(headers or {})}
                             ) as response:
        result.status = response.status_code
        result.request_id = response.headers.get("x-fairserve-request-id")
        async for line in response.aiter_lines():
            if line.startswith("id:"):
                result.event_ids.append(line[3:].strip())
            if line.startswith("data:"):
                _take(result, line[5:].strip())


async def wait_for_tokens(results: list[StreamResult], min_chars: int, timeout_s: float) -> None:
    """Until every stream has at least ``min_chars`` of text (so a kill lands mid-stream)."""
    deadline = time.monotonic() + timeout_s
    while any(len(r.text) < min_chars for r in results):
        if time.monotonic() > deadline:
            raise AssertionError(f"streams did not start: {[len(r.text) for r in results]}")
        await asyncio.sleep(0.05)


async def resilient_stream(client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any],
                           result: StreamResult, timeout_s: float = 240.0) -> int:
    """A streaming client that survives its connection: when the stream breaks before its
    [DONE], it reconnects (``GET /chat/completions/{id}?stream=true`` with the last
    ``Last-Event-ID`` it saw) until the stream ends. Returns how many times it reconnected."""
    request_id: str | None = None
    last_id: str | None = None
    reconnects = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if request_id is None:
                request = client.stream("POST", f"{base}/chat/completions",
                                        json={**body, "stream": True},
                                        headers={"Authorization": f"Bearer {key}"})
            else:
                extra = {"Last-Event-ID": last_id} if last_id else {}
                request = client.stream(
                    "GET", f"{base}/chat/completions/{request_id}", params={"stream": "true"},
                    headers={"Authorization": f"Bearer {key}", **extra})
            async with request as response:
                if response.status_code != 200:
                    raise httpx.TransportError(f"HTTP {response.status_code}")
                request_id = request_id or response.headers["x-fairserve-request-id"]
                event_id = None
                async for line in response.aiter_lines():
                    if line.startswith("id:"):
                        event_id = line[3:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue
                    _take(result, line[5:].strip())
                    if event_id is not None:
                        last_id = event_id
                    event_id = None
            if result.num_done:
                return reconnects
        except (httpx.TransportError, httpx.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the stream of {request_id} never ended: {result}")
        reconnects += 1
        await asyncio.sleep(0.5)


def assert_exact(results: list[StreamResult], expected: list[str], max_tokens: int) -> None:
    """Every client received, in the end, exactly the uninterrupted text: no error, one
    ``[DONE]``, finish ``length``, usage counting each of ``max_tokens`` once."""
    for i, (result, text) in enumerate(zip(results, expected, strict=True)):
        assert not result.errors, (i, result.errors)
        assert result.num_done == 1 and result.finish_reasons == ["length"], (i, result)
        assert result.text == text, (i, result.text, text)
        assert result.usage is not None
        assert result.usage["completion_tokens"] == max_tokens, (i, result.usage)


def _take(result: StreamResult, payload: str) -> None:
    if payload == "[DONE]":
        result.num_done += 1
        return
    event = json.loads(payload)
    result.events.append(event)
    if "error" in event:
        result.errors.append(event["error"])
        return
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event.get("choices", []):
        result.text += choice.get("delta", {}).get("content") or ""
        if choice.get("finish_reason"):
            result.finish_reasons.append(choice["finish_reason"])


def unstreamed(body: dict[str, Any]) -> dict[str, Any]:
    """A streaming request's body as a plain one (no ``stream_options``)."""
    return {k: v for k, v in body.items() if k != "stream_options"}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def leftovers(redis_url: str, tenants: tuple[str, ...], timeout_s: float = 60.0
                    ) -> dict[str, object]:
    """Waits for the cluster to settle; what is still held then (empty: nothing): request
    leases, ``tenants``' queues and open readers, detached requests, reader leases, replica
    slots, engine sequences and KV blocks."""
    client = connect(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            held: dict[str, object] = {}
            if leases := await client.zcard(keys.leases()):
                held["leases"] = leases
            for tenant in tenants:
                if queued := await client.llen(keys.queue(tenant)):
                    held[f"queue {tenant}"] = queued
                opened = await client.hmget(keys.state(tenant), "open_stream", "open_resume")
                if any(int(n or 0) for n in opened):
                    held[f"readers {tenant}"] = opened
            if readers := await client.zcard(keys.readers()):
                held["reader leases"] = readers
            if detached := await client.zcard(keys.detached()):
                held["detached"] = detached
            for load in await read_loads(client):
                if load.ongoing or load.num_running or load.num_waiting:
                    held[f"{load.replica_id} slots"] = (load.ongoing, load.num_running,
                                                       load.num_waiting)
                if load.num_free_kv_blocks != load.num_total_kv_blocks:
                    held[f"{load.replica_id} kv"] = load.num_total_kv_blocks - load.num_free_kv_blocks
            if not held or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()
