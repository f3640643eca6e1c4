"""The end-to-end cluster and helpers: tenants, keys, clients, and what Redis says."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from cluster.launcher import LocalCluster, add_tenant_with_key
from cluster.ports import free_port
from cluster.settings import load_settings
from replicas.protocol import ModelInfo, ReplicaLoad
from router.messages import RequestRecord
from router.state import keys
from router.state.capacity import read_loads
from router.state.queues import TenantQueues
from router.state.redis_client import connect
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore

MODEL = "SmolLM2-135M-Instruct"
NUM_REPLICAS = 2
SLOTS_PER_REPLICA = 16
IDLE_TIMEOUT_S = 60.0


@dataclass
class E2ECluster:
    launcher: LocalCluster
    base_url: str
    redis_url: str
    demo_key: str
    metrics_url: str  # the routers' /metrics, on the operators' port
    admin_url: str  # the routers' admin API (/admin/v1/...), on the operators' side

    def client(self, key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key or self.demo_key,
                             max_retries=0, timeout=300, **kwargs)

    def async_client(self, key: str | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key or self.demo_key,
                                  max_retries=0, timeout=600, **kwargs)

    @property
    def model_info(self) -> ModelInfo:
        assert self.launcher.model_info is not None
        return self.launcher.model_info

    def add_tenant(self, tenant: Tenant) -> str:
        """Create (or replace) a tenant; returns a new API key of it."""
        return add_tenant_with_key(self.redis_url, tenant)

    async def request_record(self, tenant_id: str, request_id: str) -> RequestRecord:
        client = connect(self.redis_url)
        try:
            return await TenantQueues(Scripts(client)).get(tenant_id, request_id)
        finally:
            await client.aclose()

    async def redis_state(self) -> tuple[int, list[ReplicaLoad], dict[str, int]]:
        """Live leases, replica load reports, and queued requests per tenant."""
        client = connect(self.redis_url)
        try:
            leased = int(await client.zcard(keys.leases()))
            loads = await read_loads(client)
            tenants = await TenantStore(Scripts(client)).all()
            queued = {t.id: int(await client.llen(keys.queue(t.id))) for t in tenants}
            return leased, loads, queued
        finally:
            await client.aclose()

    async def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> tuple[int, list[ReplicaLoad]]:
        """Until nothing is leased, queued or running on any replica; returns the last state."""
        deadline = time.monotonic() + timeout_s
        while True:
            leased, loads, queued = await self.redis_state()
            busy = leased or any(queued.values()) or any(
                x.ongoing or x.num_running or x.num_waiting for x in loads)
            if not busy and len(loads) == NUM_REPLICAS:
                return leased, loads
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not idle after {timeout_s} s: leased {leased}, "
                                     f"queued {queued}, replicas {loads}")
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        self.launcher.stop()


def start_cluster(state_dir: Path) -> E2ECluster:
    admin_port = free_port()
    settings = load_settings(
        state_dir=state_dir,
        engine={"num_threads": 1, "max_num_seqs": 32},
        replicas={"num_replicas": NUM_REPLICAS, "num_cpus": 0.5,
                  "max_ongoing_requests": SLOTS_PER_REPLICA, "graceful_shutdown_timeout_s": 5},
        router={"num_replicas": 2, "num_cpus": 0.25, "port": free_port(),
                "api": {"detach_grace_s": 5.0, "metrics_port": free_port(),
                        "admin_port": admin_port}},
        redis={"port": free_port()},
        ray={"num_cpus": 2},
    )
    launcher = LocalCluster(settings)
    try:
        info = launcher.start()
    except BaseException:
        launcher.stop()
        raise
    assert info.demo_key is not None, "a fresh cluster creates the demo tenant"
    return E2ECluster(launcher, info.base_url, info.redis_url, info.demo_key, info.metrics_url,
                      f"http://127.0.0.1:{admin_port}")
