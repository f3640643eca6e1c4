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
Every answer is tallied by kind and status (a 429 with its code; a connection error under its
exception's name); the tallies go to OUT.json. A 429's Retry-After is waited out before that
connection's next request, as the OpenAI SDKs do; nothing else is: each stream is reopened the
moment it ends. (A client that ignores Retry-After and sends again at once is an HTTP flood,
which is the edge's to limit: the ingress or a load balancer in front, by key or by address.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

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
    """A JSON schema whose JSON nests ``depth`` levels at most (objects in objects: each adds a
    schema and its ``properties``), padded to about ``size`` bytes serialized with a description
    (no effect on what it accepts)."""
    schema: dict[str, Any] = {"type": "string", "maxLength": 8}
    for level in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {f"l{level}": schema},
                  "required": [f"l{level}"]}
    pad = size - len(json.dumps(schema)) - 40
    schema["description"] = "x" * max(0, pad)
    return schema


class Tally:
    def __init__(self) -> None:
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.samples: dict[str, str] = {}  # "kind status" -> the first answer's start
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)

    def add(self, kind: str, outcome: int | str, answer: bytes = b"",
            seconds: float | None = None) -> None:
        self.by_kind[kind][str(outcome)] += 1
        self.samples.setdefault(f"{kind} {outcome}", answer[:300].decode(errors="replace"))
        if seconds is not None:
            self.seconds[f"{kind} {outcome}"].append(seconds)


async def raw_request(base: str, method: str, path: str, key: str, body: bytes | None,
                      tally: Tally, kind: str, headers: dict[str, str] | None = None) -> None:
    """One HTTP/1.1 request on a connection of its own (``Connection: close``), its answer read
    to the end, on bare asyncio streams: an httpx client with thousands of connections spends
    more CPU on itself than the cluster spends on it, and the attacker would only flood itself."""
    url = urlsplit(base)
    head = [f"{method} {url.path}{path} HTTP/1.1", f"Host: {url.netloc}", "Connection: close",
            f"Authorization: Bearer {key}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    started = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write("\r\n".join(head).encode() + b"\r\n\r\n" + (body or b""))
        answer = await reader.read(65536)
        while len(answer) < 4096 and (more := await reader.read(65536)):
            answer += more
        while await reader.read(65536):
            pass
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "no status"
        body = answer.partition(b"\r\n\r\n")[2]
        if status == "429":  # which limit: the error's code
            status += " " + body.split(b'"code":', 1)[-1].strip(b' "}').split(b'"')[0].decode()
        tally.add(kind, status, body, time.monotonic() - started)
        retry_after = _header(answer, b"retry-after")
        if status.startswith("429") and retry_after is not None:
            writer.close()
            await asyncio.sleep(float(retry_after))  # as the openai SDK does
    except OSError as exc:
        tally.add(kind, type(exc).__name__, str(exc).encode())
    finally:
        if writer is not None:
            writer.close()


def _header(answer: bytes, name: bytes) -> bytes | None:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def flood(base: str, key: str, streams: int, until: float, tally: Tally) -> None:
    """``streams`` distinct streamed requests at once, each replaced as it ends."""
    async def one(slot: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            await raw_request(base, "POST", "/chat/completions", key, dumps(chat(
                f"Write a story about the number {slot * 1000 + n}.", 48, stream=True)),
                tally, "stream")
    await asyncio.gather(*(one(slot) for slot in range(streams)))


async def long_request(http: httpx.AsyncClient, base: str, key: str, tally: Tally
                       ) -> tuple[asyncio.Task[None], dict[str, Any], str, str]:
    """The attacker's long request, streamed: its task, body, Idempotency-Key and id."""
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

    task = asyncio.create_task(first())
    deadline = time.monotonic() + 60
    while not request_id and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.05)
    if not request_id:
        await task
        raise RuntimeError("the attacker's long request was not admitted")
    return task, body, idem, request_id[0]


async def joins_and_resumes(base: str, key: str, readers: int,
                            until: float, tally: Tally, body: dict[str, Any], idem: str,
                            request_id: str) -> None:
    """``readers`` retries joining the long request by its Idempotency-Key and ``readers``
    resumes of it, all at once, again until ``until``."""
    while time.monotonic() < until:
        await asyncio.gather(
            *(raw_request(base, "POST", "/chat/completions", key, dumps(body), tally, "join",
                          {"Idempotency-Key": idem}) for _ in range(readers)),
            *(raw_request(base, "GET", f"/chat/completions/{request_id}?stream=true", key, None,
                          tally, "resume") for _ in range(readers)))


async def at_the_limits(base: str, key: str, until: float, tally: Tally) -> None:
    """Bodies at (and just over) the limits, one after another."""
    huge_prompt = chat("word " * ((MIB - 4096) // 5), 16)
    too_big = chat("word " * (MIB // 5 + 64), 16)
    schema = chat("Give me a nested object.", 16, response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(
            MAX_SCHEMA_DEPTH, MAX_SCHEMA_BYTES - 256)}})
    stops = chat("Count to ten.", 16, stop=[f"{i}" + "z" * (MAX_STOP_STRING_CHARS - 2)
                                               for i in range(MAX_STOP_STRINGS)])
    cases = {"1mib_prompt": dumps(huge_prompt), "over_1mib": dumps(too_big),
             "schema": dumps(schema), "stops": dumps(stops)}
    while time.monotonic() < until:
        for kind, body in cases.items():
            await raw_request(base, "POST", "/chat/completions", key, body, tally, kind)


async def attack(base: str, key: str, seconds: float, streams: int, readers: int) -> Tally:
    tally = Tally()
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=60), limits=limits) as http:
        long_task, body, idem, request_id = await long_request(http, base, key, tally)
        await asyncio.gather(
            flood(base, key, streams, until, tally),
            joins_and_resumes(base, key, readers, until, tally, body, idem, request_id),
            at_the_limits(base, key, until, tally))
        await long_task
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
                   "by_kind": {k: dict(v) for k, v in tally.by_kind.items()},
                   "median_s": {k: statistics.median(v) for k, v in tally.seconds.items()},
                   "samples": tally.samples}, out, indent=1)


if __name__ == "__main__":
    main()
