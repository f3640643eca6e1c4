"""Usage records on the real cluster: over a mixed workload (whole, streamed, ``n=2``, a prompt
found in the prefix cache, ``/v1/completions``) a tenant's record equals, field by field, the sum
of the usage its clients were told; an abandoned stream shows as one cancelled request; and
``fairserve usage`` prints it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.cli import main
from router.state.redis_client import connect
from router.state.tenants import Tenant
from router.state.usage import UsageReader
from tests.e2e.factories import MODEL, E2ECluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LONG = ("You are a careful assistant who answers questions about lighthouses, their keepers "
        "and the ships that pass them at night. ") * 6


def _sum(total: dict[str, int], usage: object) -> None:
    total["prompt_tokens"] += usage.prompt_tokens
    total["completion_tokens"] += usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    total["cached_tokens"] += (details.cached_tokens or 0) if details else 0
    total["requests"] += 1


def _record(e2e: E2ECluster, tenant: str) -> dict[str, int]:
    async def read() -> dict[str, int]:
        client = connect(e2e.redis_url)
        try:
            now = int(time.time() * 1000)
            rows = await UsageReader(client).read(now - 7_200_000, now + 1, [tenant],
                                                  group_by=["tenant"])
        finally:
            await client.aclose()
        return rows[0].counts if rows else {}

    return asyncio.run(read())


def test_the_record_is_the_sum_of_what_the_clients_were_told(e2e: E2ECluster, capsys) -> None:
    key = e2e.add_tenant(Tenant(id="metered"))
    client = e2e.client(key)
    told = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "requests": 0}
    ask = [{"role": "system", "content": LONG}, {"role": "user", "content": "Name one."}]

    for _ in range(3):  # the later ones find the first's prompt in the prefix cache
        reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=6,
                                               temperature=0)
        _sum(told, reply.usage)
    assert told["cached_tokens"] > 0
    _sum(told, client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, n=2,
                                              temperature=1, seed=3).usage)
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=7, stream=True,
                                            stream_options={"include_usage": True})
    usages = [c.usage for c in stream if c.usage is not None]
    _sum(told, usages[-1])
    _sum(told, client.completions.create(model=MODEL, prompt="Once upon a time",
                                         max_tokens=4).usage)
    record = _record(e2e, "metered")
    assert {k: record.get(k, 0) for k in told} == told
    assert record["engine_ms"] > 0  # (queue_ms may round to 0 on an idle cluster)

    # a stream its client abandons after the first chunk (long enough to outlive the detach
    # grace): one cancelled request
    body = {"model": MODEL, "messages": ask, "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", f"{e2e.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {key}"}, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 120
    while _record(e2e, "metered").get("cancelled", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    after = _record(e2e, "metered")
    assert after["cancelled"] == 1 and after["requests"] == told["requests"] + 1

    assert main(["usage", "--redis-url", e2e.redis_url, "--tenant", "metered", "--since", "2h",
                 "--group-by", "tenant", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["requests"] == after["requests"] and row["cancelled"] == 1
