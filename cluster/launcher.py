"""Brings a fairserve cluster up: Ray (local or given) and a check that the application fits
it, Redis (embedded or given, waited for until its data is loaded), the tenants, and the Serve
application; and takes it down again.

Used by ``fairserve up`` and by the end-to-end tests, so both start exactly the same cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

from cluster.app import REPLICA_DEPLOYMENT, ROUTER_DEPLOYMENT, build_app
from cluster.ingress import ingress_env, ingress_files
from cluster.placement import RayResources, max_model_replicas, place
from cluster.ray_quiet import QUIET_ENV
from cluster.redis_server import EmbeddedRedis
from cluster.settings import FairserveSettings, ServedModelSettings
from replicas.model_info import describe_model
from replicas.protocol import ModelInfo
from replicas.server import EngineFactory
from router.state.api_keys import ApiKeys
from router.state.redis_client import connect, wait_loaded
from router.state.scripts import Scripts
from router.state.tenants import Tenant, TenantStore, load_tenants, load_tenants_file

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
DEMO_KEY_FILE = "demo-key"
READY_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 3.0


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    base_url: str  # ends in /v1
    redis_url: str
    demo_key: str | None  # the demo tenant's key, when this launcher created or kept it
    ray_address: str = ""  # the GCS address of its Ray cluster (host:port), to join it exactly
    metrics_url: str = ""  # the routers' /metrics (the operators' port); "" when not served


def metrics_url(settings: FairserveSettings) -> str:
    """Where the routers of this machine serve ``/metrics``; "" when they do not."""
    api = settings.router.api
    if api.metrics_port is None:
        return ""
    host = "127.0.0.1" if api.metrics_host in ("0.0.0.0", "::") else api.metrics_host
    return f"http://{host}:{api.metrics_port}/metrics"


def _replicas_line(model: ServedModelSettings) -> str:
    scaling = model.replicas.autoscaling
    count = (f"{model.replicas.num_replicas} replica(s)" if scaling is None else
             f"{max(scaling.floor, 1) if scaling.floor else 0} replica(s) (autoscaling "
             f"{scaling.floor}-{scaling.max_replicas})")
    return count + (f" of {model.name}" if model.pool else "")


class LocalCluster:
    def __init__(self, settings: FairserveSettings, engine_factory: EngineFactory | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.engine_factory = engine_factory
        self.progress = progress or (lambda line: logger.info("%s", line))
        self.redis: EmbeddedRedis | None = None
        self.info: ClusterInfo | None = None
        self.model_info: ModelInfo | None = None  # what the routers know of the default model
        self.model_infos: list[ModelInfo] = []  # ... of each served model, the default first
        self._started_ray = False
        self._started_serve = False
        self._ingress_files: Path | None = None

    def start(self) -> ClusterInfo:
        started = time.perf_counter()
        self._start_ray()
        # first, so a configuration that cannot be placed fails in seconds, before any work
        self.settings = s = place(self.settings, RayResources.of_ray(is_local=self._started_ray))
        self.progress(f"placement: {max_model_replicas(s)} model replica(s) x "
                      f"{s.replicas.num_cpus:g} CPU, {s.router.num_replicas} router(s) x "
                      f"{s.router.num_cpus:g} CPU of {ray.cluster_resources().get('CPU', 0):g}")
        redis_url = self._start_redis()
        demo_key = asyncio.run(self._prepare_tenants(redis_url))
        served = s.served_models()
        self.progress(f"reading the model{'s' if len(served) > 1 else ''} "
                      f"{', '.join(str(m.engine.model) for m in served)} ...")
        self.model_infos = infos = [describe_model(m.engine) for m in served]
        self.model_info = infos[0]
        serve.start(proxy_location=s.router.proxy_location.value,
                    http_options={"host": s.router.host, "port": s.router.port})
        self._started_serve = True
        self.progress(f"deploying {' and '.join(_replicas_line(m) for m in served)} and "
                      f"{s.router.num_replicas} router(s); loading the "
                      f"model{'s' if len(served) > 1 else ''} ...")
        app = build_app(s, infos, redis_url, self.engine_factory)
        watcher = _StatusWatcher(s.app_name, self.progress)
        watcher.start()
        try:
            serve.run(app, name=s.app_name, route_prefix="/")
        finally:
            watcher.stop()
        host = "127.0.0.1" if s.router.host in ("0.0.0.0", "::") else s.router.host
        base = f"http://{host}:{s.router.port}"
        if any(m.replicas.num_replicas > 0 or m.replicas.autoscaling is not None
               for m in served):
            _wait_ready(base, READY_TIMEOUT_S)  # at zero replicas ready means scale-from-zero
        self.progress(f"ready in {time.perf_counter() - started:.1f} s")
        self.info = ClusterInfo(f"{base}/v1", redis_url, demo_key,
                                ray.get_runtime_context().gcs_address, metrics_url(s))
        return self.info

    def stop(self) -> None:
        if self._started_serve:
            try:
                serve.delete(self.settings.app_name)
            except Exception as exc:  # noqa: BLE001 - best effort while tearing down
                logger.warning("deleting the Serve application failed: %s", exc)
            if self._started_ray:
                serve.shutdown()
            self._started_serve = False
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._ingress_files is not None:  # HAProxy's config and socket, once Ray is down
            shutil.rmtree(self._ingress_files, ignore_errors=True)
            self._ingress_files = None

    # ---- steps ----

    def _start_redis(self) -> str:
        s = self.settings
        given = s.redis.url_with_password()
        if given:
            return given
        self.progress("starting the embedded redis-server ...")
        self.redis = EmbeddedRedis(s.state_dir / "redis", port=s.redis.port,
                                   appendfsync=s.redis.appendfsync, progress=self.progress).start()
        return self.redis.url

    def _start_ray(self) -> None:
        s = self.settings
        if ray.is_initialized():
            return
        self.progress("starting Ray ..." if s.ray.address is None else
                      f"connecting to Ray at {s.ray.address} ...")
        # Ray's processes take the ingress and their settings (ray_quiet.py) from the
        # environment they start in (a local Ray's raylet keeps the one it had at ray.init;
        # this process's is put back after)
        env: dict[str, str] = {}
        if s.ray.address is None:
            env = {**(QUIET_ENV if s.ray.quiet else {}), **ingress_env(s)}
        self._ingress_files = ingress_files(env)
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            # the replicas' torch threads are set by the engine, not by OMP defaults per worker
            ray.init(address=s.ray.address,
                     num_cpus=s.ray.num_cpus if s.ray.address is None else None,
                     include_dashboard=False,
                     log_to_driver=os.environ.get("FAIRSERVE_RAY_LOGS") == "1",
                     namespace="fairserve")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self._started_ray = True

    async def _prepare_tenants(self, redis_url: str) -> str | None:
        s = self.settings
        client = connect(redis_url)
        try:
            # a restarted Redis answers while it replays its AOF and refuses the rest (LOADING)
            await wait_loaded(client, progress=self.progress)
            scripts = Scripts(client)
            store = TenantStore(scripts)
            if s.tenants.file is not None:
                result = await load_tenants(scripts, load_tenants_file(s.tenants.file))
                self.progress(f"tenants from {s.tenants.file}: {result.summary}")
            if not s.tenants.create_demo:
                return None
            key_file = s.state_dir / DEMO_KEY_FILE
            existing = await store.all()
            if any(t.id == DEMO_TENANT for t in existing) and key_file.is_file():
                return key_file.read_text().strip()
            if existing:
                return None
            await store.put(Tenant(id=DEMO_TENANT))
            created_key = await ApiKeys(scripts).create(DEMO_TENANT, label="fairserve up")
            _write_secret(key_file, created_key.secret)
            self.progress(f"created tenant {DEMO_TENANT!r} and an API key (kept in {key_file})")
            return created_key.secret
        finally:
            await client.aclose()


def _write_secret(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def _wait_ready(base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(f"the cluster is not ready after {timeout_s} s: {last}")


class _StatusWatcher:
    """Prints the deployments' states while ``serve.run`` waits for them (the model loads)."""

    def __init__(self, app_name: str, progress: Callable[[str], None]) -> None:
        self.app_name = app_name
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="serve-status")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        started = time.monotonic()
        last = ""
        while not self._stop.wait(PROGRESS_EVERY_S):
            try:
                app = serve.status().applications.get(self.app_name)
            except Exception:  # noqa: BLE001 - the controller may still be starting
                continue
            if app is None:
                continue
            parts = []
            # the model deployments (ModelReplica, ModelReplica-<name>...), then the router
            names = sorted(n for n in app.deployments if n.startswith(REPLICA_DEPLOYMENT))
            for name in (*names, ROUTER_DEPLOYMENT):
                deployment = app.deployments.get(name)
                if deployment is not None:
                    states = {str(k.value if hasattr(k, "value") else k).lower(): v
                              for k, v in deployment.replica_states.items()}
                    parts.append(f"{name}: " + json.dumps(states))
            line = "  ".join(parts)
            if line and line != last:
                self.progress(f"  {time.monotonic() - started:5.0f} s  {line}")
                last = line


def add_tenant_with_key(redis_url: str, tenant: Tenant, label: str = "") -> str:
    """Create or replace ``tenant`` and return a new API key of it (benchmarks, tests)."""

    async def go() -> str:
        client = connect(redis_url)
        try:
            scripts = Scripts(client)
            await TenantStore(scripts).put(tenant)
            return (await ApiKeys(scripts).create(tenant.id, label=label)).secret
        finally:
            await client.aclose()

    return asyncio.run(go())
