"""Redis behind Sentinel (``redis+sentinel://`` URLs, router/state/redis_client.py) and
admissions acknowledged by replicas (``queues.replicas_to_ack``: a ``WAIT`` in the admission's
own pipeline).

Real servers: a primary, a replica of it and a Sentinel watching them, all the embedded
``redis-server`` binary. Killing the primary with SIGKILL, the Sentinel promotes the replica;
the clients (async and blocking) follow it by themselves, and an admission the replica had
acknowledged is on the new primary. With more replicas wanted than there are, the admission is
refused (503 ``not_replicated``) after the timeout instead of acknowledged."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cluster.status import redis_role
from router.config import QueueSettings
from router.errors import NotReplicatedError
from router.state import keys
from router.state.queues import TenantQueues
from router.state.redis_client import connect, sentinel_address, sync_connect
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore
from tests.redis_ha import Servers, sentinel_servers
from tests.router.factories import make_request, run


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    with sentinel_servers(tmp_path) as running:
        yield running


def test_status_names_the_redis_role_and_its_replicas(servers) -> None:
    primary = redis_role(sync_connect(servers.url).info("replication"))
    assert primary.startswith("primary, 1 replica(s): 127.0.0.1:") and "online" in primary
    replica = redis_role(redis.Redis(port=servers.replica_port).info("replication"))
    assert replica == f"replica of 127.0.0.1:{servers.primary_port} (link up)"


def test_sentinel_urls_name_the_sentinels_the_service_and_the_db() -> None:
    address = sentinel_address("redis+sentinel://fs-router:p%40ss@s1:26380,s2/fairserve/2")
    assert address.sentinels == (("s1", 26380), ("s2", 26379))
    assert (address.service, address.db) == ("fairserve", 2)
    assert (address.username, address.password) == ("fs-router", "p@ss")
    for bad in ("redis://h:1/0", "redis+sentinel://h:1", "redis+sentinel://h:x/fs",
                "redis+sentinel://h:1/fs/db"):
        with pytest.raises(ValueError):
            sentinel_address(bad)


def test_clients_follow_a_failover_and_acknowledged_admissions_survive_it(servers) -> None:
    settings = QueueSettings(replicas_to_ack=1, ack_timeout_ms=500)

    async def scenario() -> None:
        client = connect(servers.url, max_connections=8, socket_timeout=5,
                         socket_connect_timeout=2)
        try:
            scripts = Scripts(client)
            await TenantStore(scripts).add(Tenant(id="acme"))
            queues = TenantQueues(scripts, settings)
            await queues.admit(make_request("acme", "before"))  # acknowledged by the replica
            assert (await client.info("replication"))["role"] == "master"

            os.kill(servers.primary.pid, signal.SIGKILL)
            servers.primary.wait()
            deadline = time.monotonic() + 30
            while True:  # what a router does: its calls fail until Sentinel names a primary
                try:
                    await queues.admit(make_request("acme", "after"))
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    assert time.monotonic() < deadline, "no new primary"
                    await asyncio.sleep(0.2)
                    continue
                except NotReplicatedError:
                    break  # on the new primary, which has no replica left to acknowledge it
                raise AssertionError("acknowledged with no replica left")
            # the new primary is the old replica; it has the acknowledged request and the one
            # it could not get acknowledged (refused with 503: its client retries with its key)
            info = await client.info("server")
            assert int(info["tcp_port"]) == servers.replica_port
            assert await queues.queued_ids("acme") == ["before", "after"]
        finally:
            await client.aclose()

    run(asyncio.wait_for(scenario(), 90))
    blocking = sync_connect(servers.url, socket_timeout=2)
    assert int(blocking.info("server")["tcp_port"]) == servers.replica_port
    assert blocking.exists(keys.request("acme", "before"))


def test_an_admission_fewer_replicas_acknowledged_is_refused_not_acknowledged(servers) -> None:
    settings = QueueSettings(replicas_to_ack=2, ack_timeout_ms=200)  # there is one replica

    async def scenario() -> None:
        client = connect(servers.url)
        try:
            scripts = Scripts(client)
            await TenantStore(scripts).add(Tenant(id="acme"))
            started = time.monotonic()
            with pytest.raises(NotReplicatedError) as err:
                await TenantQueues(scripts, settings).admit(make_request("acme", "r1"))
            assert time.monotonic() - started >= 0.2
            assert err.value.status == 503 and err.value.code == "not_replicated"
            assert err.value.retry_after_s > 0
            assert "1 acknowledged" in err.value.message
        finally:
            await client.aclose()

    run(scenario())
