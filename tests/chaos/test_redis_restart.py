"""kill -9 of the cluster's redis-server under 8 streams, and a restart on its data directory
(appendfsync always): while it is down new requests get 503 with Retry-After, at once (never a
500, never a hang); the running streams ride the outage out and end with the uninterrupted
text; nothing admitted is lost."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from cluster.redis_server import AppendFsync, EmbeddedRedis
from tests.chaos.factories import (
    StreamResult,
    kill,
    pids_titled,
    start,
    stream_chat,
    wait_for_tokens,
)
from tests.chaos.test_migration import MAX_TOKENS, bodies, references, settings

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.e2e]

NUM_STREAMS = 8
OUTAGE_S = 3.0


def short_request() -> dict:
    body = {**bodies()[0], "max_tokens": 4}
    del body["stream_options"]  # not streamed
    return body


async def restart_redis_under_load(base: str, key: str, redis_port: int, data_dir
                                   ) -> tuple[list[StreamResult], list[httpx.Response], EmbeddedRedis]:
    results = [StreamResult() for _ in range(NUM_STREAMS)]
    refused: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_chat(client, base, key, body, result))
                 for body, result in zip(bodies()[:NUM_STREAMS], results, strict=True)]
        await wait_for_tokens(results, min_chars=8, timeout_s=120)
        (server,) = pids_titled(f"redis-server 127.0.0.1:{redis_port}", None)
        kill(server, signal.SIGKILL)
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:  # new requests while Redis is down
            started = time.monotonic()
            refused.append(await client.post(
                f"{base}/chat/completions", timeout=15, headers={"Authorization": f"Bearer {key}"},
                json=short_request()))
            refused[-1].extensions["elapsed_s"] = time.monotonic() - started
            await asyncio.sleep(0.3)
        restarted = EmbeddedRedis(data_dir, port=redis_port, appendfsync=AppendFsync.ALWAYS).start()
        await asyncio.gather(*tasks)
    return results, refused, restarted


def test_a_redis_restart_under_streams_loses_nothing_and_refuses_cleanly(tmp_path) -> None:
    config = settings(2)
    config["redis"] = {"appendfsync": "always"}
    up, base, key, redis_url = start(tmp_path, config)
    restarted = None
    try:
        expected = asyncio.run(references(base, key))[:NUM_STREAMS]
        port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        results, refused, restarted = asyncio.run(
            restart_redis_under_load(base, key, port, tmp_path / "redis"))
        assert refused, "no request was sent during the outage"
        for response in refused:
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"]
            assert response.extensions["elapsed_s"] < 12  # refused, not left hanging
        for i, (result, text) in enumerate(zip(results, expected, strict=True)):
            assert result.status == 200 and not result.errors, (i, result.errors)
            assert result.num_done == 1 and result.text == text, (i, result.text, text)
            assert result.usage["completion_tokens"] == MAX_TOKENS, (i, result.usage)
        after = httpx.post(f"{base}/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {key}"},
                           json=short_request())
        assert after.status_code == 200, after.text  # serving again, tenant and key intact
    finally:
        up.stop()
        if restarted is not None:
            restarted.stop()
