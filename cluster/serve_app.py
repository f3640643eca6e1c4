"""The Serve application as a Ray cluster deploys it from a config file: KubeRay's
``serveConfigV2`` (the Helm chart renders it) or ``serve deploy``.

    applications:
      - name: fairserve
        route_prefix: /
        import_path: cluster.serve_app:build
        args: {settings: {engine: {...}, replicas: {...}, router: {...}, queues: {...},
                          redis: {url: redis://fairserve-redis:6379/0},
                          tenants: {file: /etc/fairserve/tenants/tenants.yaml}}}

``args.settings`` is the settings tree (``cluster/settings.py``), one to one, and goes through
the same validation as ``fairserve up``'s, so a bad value fails the deploy with a message that
names it. The ``FAIRSERVE_*`` environment of the Ray pods applies under it.

NOTE: the config is plaintext in the RayService and on the Ray dashboard, so no secret may be in
it. Secrets come from the pods' environment (Kubernetes ``secretKeyRef``s):
``FAIRSERVE_REDIS__PASSWORD`` (put into ``redis.url``) or a whole ``FAIRSERVE_REDIS__URL`` when
the chart leaves ``redis.url`` out. Tenants come from a mounted Secret named by
``tenants.file``, holding hashed keys only (``router/state/tenants.py``), and are loaded on every
deploy (idempotent).

Ray Serve runs this builder as a task with no CPU (on the head, or any node), so what it reads
(the model's tokenizer and config, the tenants file) must be on every Ray pod: the image's
default model, a volume the chart mounts everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.serve import Application

from cluster.app import build_app
from cluster.settings import FairserveSettings, load_settings
from replicas.model_info import describe_model
from router.state.admin_tokens import AdminTokens
from router.state.audit import AuditLog
from router.state.redis_client import connect, wait_loaded
from router.state.scripts import Scripts
from router.state.tenants import load_tenants, load_tenants_file

logger = logging.getLogger(__name__)

REDIS_WAIT_S = 120.0  # Redis may still be starting (or replaying its AOF) on a first install


def build(args: dict[str, Any]) -> Application:
    """The application of ``args.settings`` (Ray Serve's application builder)."""
    unknown = set(args) - {"settings"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}: only 'settings' is taken")
    settings = load_settings(**(args.get("settings") or {}))
    written_url, redis_url = settings.redis.url, settings.redis.url_with_password()
    if not written_url or not redis_url:
        raise ValueError("redis.url: a deployed cluster needs its Redis (set redis.url in the "
                         "settings, or FAIRSERVE_REDIS__URL in the pods' environment)")
    served = settings.served_models()
    for i, model in enumerate(served):
        if model.replicas.num_cpus is None:
            at = f"models[{i - 1}]." if model.pool else ""
            raise ValueError(f"{at}replicas.num_cpus: a deployed cluster's replicas need their "
                             "CPUs set (only `fairserve up` fits them to the machine)")
    asyncio.run(_prepare_redis(settings, redis_url))
    infos = [describe_model(m.engine) for m in served]
    logger.info("building %s: %d router(s), model(s) %s", settings.app_name,
                settings.router.num_replicas, ", ".join(str(m.engine.model) for m in served))
    # the deployments get the URL as written; each adds the password from its own environment
    return build_app(settings, infos, written_url)


async def _prepare_redis(settings: FairserveSettings, redis_url: str) -> None:
    client = connect(redis_url)
    try:
        await wait_loaded(client, REDIS_WAIT_S, progress=lambda line: logger.info("%s", line))
        if settings.tenants.file is not None:
            log = AuditLog(client, settings.queues.audit_retention_days,
                           settings.queues.audit_max_entries)
            result = await load_tenants(Scripts(client), load_tenants_file(settings.tenants.file),
                                        audit=log, actor=f"file:{settings.tenants.file}")
            logger.info("tenants from %s: %s", settings.tenants.file, result.summary)
        tokens_file = settings.router.api.admin_tokens_file
        if tokens_file is not None:
            added, revoked = await AdminTokens(client).load_file(tokens_file)
            log = AuditLog(client, settings.queues.audit_retention_days,
                           settings.queues.audit_max_entries)
            for token_id in added:
                await log.record(f"file:{tokens_file}", "admin_token.create", token_id)
            for token_id in revoked:
                await log.record(f"file:{tokens_file}", "admin_token.revoke", token_id)
            logger.info("admin tokens from %s: %d added, %d revoked", tokens_file, len(added),
                        len(revoked))
    finally:
        await client.aclose()
