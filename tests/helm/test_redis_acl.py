"""The embedded Redis's ACL users per role (``redis.embedded.auth.roleUsers``), as the chart's
start script writes them, on the real redis-server: the routers' user runs the whole request
path but no admin command; the model replicas' user appends to a request's stream and publishes
its load report, and can neither read nor mint API keys nor change a tenant. Each Ray pod gets
its role's user and only its own password."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from cluster.ports import free_port
from cluster.redis_server import find_redis_server
from replicas.protocol import ReplicaLoad
from router.dispatch.streams import Event, ResponseStreams
from router.errors import RouterError
from router.state import keys
from router.state.api_keys import ApiKeys
from router.state.load_report import LoadReporter
from router.state.queues import TenantQueues
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore
from tests.helm.chart import of_kind, rayservice, render, values_of
from tests.helm.test_redis_password import AUTH, start_script
from tests.router.factories import make_request

# refused by ACL: directly (NOPERM), or inside a script
DENIED = re.compile(r"NOPERM|no permissions|can't run this command|can't access")
PASSWORDS = {"password": "admin-pw", "router-password": "router 'pw'", "replica-password": 're"pl'}


def start_redis(tmp_path: Path):
    import subprocess

    auth = tmp_path / "auth"
    auth.mkdir()
    for name, value in PASSWORDS.items():
        (auth / name).write_text(value + "\n")
    port = free_port()
    (tmp_path / "redis.conf").write_text(f'port {port}\nsave ""\ndir {tmp_path}\n'
                                         f"include {tmp_path}/auth.conf\n")
    script = (start_script().replace("/etc/redis-auth/", f"{auth}/")
              .replace("/run/redis/auth.conf", str(tmp_path / "auth.conf"))
              .replace("exec redis-server /etc/redis/redis.conf",
                       f"exec {find_redis_server()} {tmp_path}/redis.conf"))
    server = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    admin = redis.Redis(port=port, password=PASSWORDS["password"], socket_timeout=5)
    deadline = time.monotonic() + 20
    while True:
        try:
            admin.ping()
            return server, port
        except redis.ConnectionError:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)


def as_user(port: int, user: str, password: str) -> aioredis.Redis:
    return aioredis.Redis(port=port, username=user, password=password, socket_timeout=5)


def test_each_role_does_its_work_and_nothing_more(tmp_path: Path) -> None:
    server, port = start_redis(tmp_path)

    async def scenario() -> None:
        admin = aioredis.Redis(port=port, password=PASSWORDS["password"])
        router = as_user(port, "fairserve-router", PASSWORDS["router-password"])
        replica = as_user(port, "fairserve-replica", PASSWORDS["replica-password"])
        try:
            await TenantStore(Scripts(admin)).add(Tenant(id="acme"))
            key = await ApiKeys(Scripts(admin)).create("acme")
            # the router: authentication, admission, grant, the stream, completion, its reads
            queues = TenantQueues(Scripts(router))
            assert (await ApiKeys(Scripts(router)).authenticate(key.secret)).tenant_id == "acme"
            await queues.admit(make_request("acme", "r1"))
            (grant,) = (await queues.grant("router-1", 1)).grants
            client_id = await router.client_id()
            assert isinstance(client_id, int)
            await router.client_unblock(client_id)
            await router.publish(keys.wake_channel(), b"1")
            assert await router.info("persistence")
            # the replica: appends the request's tokens, reports its load
            await ResponseStreams(Scripts(replica)).append(grant.lease,
                                                           [Event("chunk", "hello")])
            reporter = LoadReporter("redis://unused", lambda: ReplicaLoad(
                "replica-1", 8, 1, 1, 0, 10, 20, 5.0, int(time.time() * 1000)))
            await reporter.client.aclose()
            reporter.client = replica
            await reporter.report()
            await queues.complete(grant.lease, 10, 1, "stop", "{}")
            events = [e.data async for e in ResponseStreams(Scripts(router)).read("acme", "r1")]
            assert events == ["hello", "{}"]
            # ... and nothing more
            for forbidden in (lambda: ApiKeys(Scripts(replica)).create("acme"),
                              lambda: TenantStore(Scripts(replica)).update("acme", disabled=True),
                              lambda: replica.hgetall(keys.api_key("0" * 64)),
                              lambda: replica.hgetall(keys.tenant("acme")),
                              lambda: replica.smembers(keys.tenants())):
                with pytest.raises((redis.exceptions.NoPermissionError, RouterError)) as err:
                    await forbidden()
                assert DENIED.search(str(err.value)), err.value
            for forbidden in (lambda: router.config_set("maxmemory", 1),
                              lambda: router.flushall(),
                              lambda: router.execute_command("DEBUG", "SLEEP", "0"),
                              lambda: router.set("other:key", 1)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await forbidden()
            assert await admin.hget(keys.tenant("acme"), "disabled") != b"1"
        finally:
            for client in (admin, router, replica):
                await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.kill()
        server.wait()


def test_each_ray_pod_gets_its_roles_user_and_only_its_password() -> None:
    spec = rayservice(render(values_of(None, **AUTH)))["spec"]["rayClusterConfig"]
    pods = {"head": spec["headGroupSpec"]}
    pods.update({g["groupName"]: g for g in spec["workerGroupSpecs"]})
    expected = {"head": (None, "password"), "routers": ("fairserve-router", "router-password")}
    for name, group in pods.items():
        template = group["template"]["spec"]
        env = {e["name"]: e.get("value") for e in template["containers"][0]["env"]}
        (volume,) = [v for v in template["volumes"] if v["name"] == "redis-password"]
        user, secret_key = expected.get(name, ("fairserve-replica", "replica-password"))
        assert env.get("FAIRSERVE_REDIS__USERNAME") == user, name
        assert volume["secret"]["items"] == [{"key": secret_key, "path": "password"}], name
    (statefulset,) = of_kind(render(values_of(None, **AUTH)), "StatefulSet")
    (auth,) = [v for v in statefulset["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "auth"]
    assert [i["path"] for i in auth["secret"]["items"]] == ["password", "router-password",
                                                            "replica-password"]
    one = {"redis": {"embedded": {"auth": {**AUTH["redis"]["embedded"]["auth"],
                                           "roleUsers": False}}}}
    spec = rayservice(render(values_of(None, **one)))["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        env = {e["name"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert "FAIRSERVE_REDIS__USERNAME" not in env
