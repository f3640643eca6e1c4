"""A hostile tenant, as its own process: everything a tenant's key allows at once, at the limits.

    python -m tests.chaos.hostile BASE_URL KEY OUT.json [--seconds 40] [--streams 2000]
        [--readers 200]

Run beside a quiet tenant by ``test_hostile_tenant.py`` (a process of its own, so the quiet
tenant's clock is not the attacker's event loop). For ``--seconds`` it keeps up, all together:
- a flood of streamed requests: ``--streams`` distinct ones opened at once, again as each ends;
- one long request of its own joined by ``--readers`` retries with its Idempotency-Key and
  ``--readers`` resumes (``GET …?stream=true``) of it, all at once, again as they end;
- bodies at the limits: a prompt of 1 MiB of text less a little, a body over 1 MiB, a JSON schema
  of the largest size and depth allowed, the most stop strings of the longest length.
Every answer is tallied by kind and status (a connection error under its exception's name); the
tallies go to OUT.json. The attacker honours no Retry-After: it is hostile.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
import uuid
from typing import Any

import httpx

from replicas.protocol import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)

MODEL = "SmolLM2-135M-Instruct"
MIB = 1024 * 1024


def chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.8,
            "messages": [{"role": "user", "content": content}], **extra}


def deep_schema(depth: int, size: int) -> dict[str, Any]:
    """A JSON schema nested ``depth`` levels (objects in objects) padded to about ``size`` bytes
    serialized, with a description (no effect on what it accepts)."""
    schema: dict[str, Any] = {"type": "string", "maxLength": 8}
    for level in range(depth - 1):
        schema = {"type": "object", "properties": {f"l{level}": schema},
                  "required": [f"l{level}"]}
    pad = size - len(json.dumps(schema)) - 40
    schema["description"] = "x" * max(0, pad)
    return schema


class Tally:
    def __init__(self) -> None:
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)

    def add(self, kind: str, outcome: int | str) -> None:
        self.by_kind[kind][str(outcome)] += 1


async def read_stream(http: httpx.AsyncClient, method: str, url: str, key: str,
                      body: dict[str, Any] | None, tally: Tally, kind: str,
                      headers: dict[str, str] | None = None) -> None:
    try:
        async with http.stream(method, url, json=body, headers={
                "Authorization": f"Bearer {key}", **(headers or {})}) as response:
            async for _ in response.aiter_raw():
                pass
            tally.add(kind, response.status_code)
    except httpx.HTTPError as exc:
        tally.add(kind, type(exc).__name__)


async def flood(http: httpx.AsyncClient, base: str, key: str, streams: int, until: float,
                tally: Tally) -> None:
    """``streams`` distinct streamed requests at once, each replaced as it ends."""
    async def one(slot: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            await read_stream(http, "POST", f"{base}/chat/completions", key,
                              chat(f"Write a story about the number {slot * 1000 + n}.", 48,
                                   stream=True), tally, "stream")
    await asyncio.gather(*(one(slot) for slot in range(streams)))


async def joins_and_resumes(http: httpx.AsyncClient, base: str, key: str, readers: int,
                            until: float, tally: Tally) -> None:
    """One long request of the attacker's, then ``readers`` retries joining it by its
    Idempotency-Key and ``readers`` resumes of it, all at once, again until ``until``."""
    idem = uuid.uuid4().hex
    body = chat("Tell me everything about the sea.", 256, stream=True)
    request_id: list[str] = []

    async def first() -> None:
        async with http.stream("POST", f"{base}/chat/completions", json=body, headers={
                "Authorization": f"Bearer {key}", "Idempotency-Key": idem}) as response:
            tally.add("long", response.status_code)
            async for line in response.aiter_lines():
                if line.startswith("data:") and not request_id and "chatcmpl" in line:
                    request_id.append(json.loads(line[5:])["id"])

    long_task = asyncio.create_task(first())
    deadline = time.monotonic() + 30
    while not request_id and time.monotonic() < deadline and not long_task.done():
        await asyncio.sleep(0.1)
    if not request_id:
        await long_task
        tally.add("long", "no id")
        return
    while time.monotonic() < until:
        await asyncio.gather(
            *(read_stream(http, "POST", f"{base}/chat/completions", key, body, tally, "join",
                          {"Idempotency-Key": idem}) for _ in range(readers)),
            *(read_stream(http, "GET", f"{base}/chat/completions/{request_id[0]}?stream=true",
                          key, None, tally, "resume") for _ in range(readers)))
    await long_task


async def at_the_limits(http: httpx.AsyncClient, base: str, key: str, until: float,
                        tally: Tally) -> None:
    """Bodies at (and just over) the limits, one after another."""
    auth = {"Authorization": f"Bearer {key}"}
    huge_prompt = chat("word " * ((MIB - 4096) // 5), 16)
    too_big = chat("word " * (MIB // 5 + 64), 16)
    schema = chat("Give me a nested object.", 16, response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(
            MAX_SCHEMA_DEPTH, MAX_SCHEMA_BYTES - 256)}})
    stops = chat("Count to ten.", 16, stop=[f"{i}" + "z" * (MAX_STOP_STRING_CHARS - 2)
                                               for i in range(MAX_STOP_STRINGS)])
    cases = {"1mib_prompt": huge_prompt, "over_1mib": too_big, "schema": schema, "stops": stops}
    while time.monotonic() < until:
        for kind, body in cases.items():
            try:
                response = await http.post(f"{base}/chat/completions", json=body, headers=auth)
                tally.add(kind, response.status_code)
            except httpx.HTTPError as exc:
                tally.add(kind, type(exc).__name__)


async def attack(base: str, key: str, seconds: float, streams: int, readers: int) -> Tally:
    tally = Tally()
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=60), limits=limits) as http:
        await asyncio.gather(flood(http, base, key, streams, until, tally),
                             joins_and_resumes(http, base, key, readers, until, tally),
                             at_the_limits(http, base, key, until, tally))
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base_url")
    parser.add_argument("key")
    parser.add_argument("out")
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--readers", type=int, default=200)
    args = parser.parse_args()
    started = time.monotonic()
    tally = asyncio.run(attack(args.base_url, args.key, args.seconds, args.streams,
                               args.readers))
    with open(args.out, "w") as out:
        json.dump({"seconds": time.monotonic() - started,
                   "by_kind": {k: dict(v) for k, v in tally.by_kind.items()}}, out, indent=1)


if __name__ == "__main__":
    main()
