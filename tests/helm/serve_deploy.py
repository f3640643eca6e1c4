"""Deploy a rendered serveConfigV2 on a local Ray, as KubeRay does on the cluster, and ask it
for a chat completion. Run as a script (its own process: the suite may hold a Ray session):

    python -m tests.helm.serve_deploy CONFIG.yaml REDIS_URL PASSWORD

The local Ray gets the custom resources the chart's worker groups advertise
(``fairserve_router``, ``fairserve_model``) and, like a Ray pod, the Redis password in its
mounted Secret only (``FAIRSERVE_REDIS__PASSWORD_FILE``); the config carries the URL without
it.
Prints one line, ``RESULT`` and JSON: the answer, and how long the deploy took.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

DEPLOY_TIMEOUT_S = 300.0
RESULT = "serve-deploy result: "


def main(config_path: str, redis_url: str, password: str) -> int:
    import ray
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    from cluster.launcher import add_tenant_with_key
    from router.state.redis_client import with_password
    from router.state.tenants import Tenant

    config = yaml.safe_load(Path(config_path).read_text())
    secret = Path(tempfile.mkdtemp(prefix="fairserve-secret-")) / "password"
    secret.write_text(password + "\n")  # as the chart mounts the Secret into every Ray pod
    os.environ["FAIRSERVE_REDIS__PASSWORD_FILE"] = str(secret)
    key = add_tenant_with_key(with_password(redis_url, password), Tenant(id="helm"))
    started = time.monotonic()
    ray.init(num_cpus=2, resources={"fairserve_router": 1000, "fairserve_model": 1000},
             include_dashboard=False, namespace="helm-deploy")
    try:
        client = serve_start(http_options=config["http_options"])
        client.deploy_apps(ServeDeploySchema.model_validate(config))
        status = _wait_running(serve, started)
        port = config["http_options"]["port"]
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
                  "messages": [{"role": "user", "content": "Which city is the capital of France?"}]})
        print(RESULT + json.dumps({"status": status, "deploy_s": round(time.monotonic() - started, 1),
                          "code": reply.status_code, "body": reply.json()}), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _wait_running(serve: object, started: float) -> str:
    while time.monotonic() - started < DEPLOY_TIMEOUT_S:
        app = serve.status().applications.get("fairserve")  # type: ignore[attr-defined]
        state = str(getattr(app, "status", "")) if app else ""
        if state.endswith("RUNNING") or state.endswith("DEPLOY_FAILED"):
            return state if state.endswith("RUNNING") else f"{state}: {app.message}"
        time.sleep(1.0)
    return "timed out"


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
