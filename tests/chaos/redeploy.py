"""Redeploy the running ``fairserve up`` application with changed settings, as an operator's
``serve deploy`` (or a Helm upgrade's in-place Serve update) does. Run as a script:

    python -m tests.chaos.redeploy CONFIG.yaml REDIS_URL RAY_ADDRESS '{"replicas": {...}}'

It joins the cluster's Ray at RAY_ADDRESS (the GCS address ``fairserve up`` writes in its
``run.json``; not ``"auto"``, which takes the newest Ray on the machine, another test's or a
developer's cluster as well as this one) in the launcher's namespace, builds the
application from the settings file with the overrides, prints ``ready``, and waits for a line
on its standard input before it ``serve.run``s the new application over the running one: a test
starts it first and says go when its streams are running, so the redeploy lands mid-stream and
not seconds later, after Ray's start-up (a redeploy that began only after the streams had ended
would prove nothing). It prints ``deploying`` as it starts and ``redeployed`` when Serve reports
the new version running. Serve stops the replicas the new version does not keep, each within its
graceful shutdown timeout, and starts the new ones. With no standard input it goes at once.
"""

from __future__ import annotations

import json
import sys

import yaml


def main(config_path: str, redis_url: str, ray_address: str, overrides_json: str) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.settings import load_settings
    from replicas.model_info import describe_model
    from tests.helm.chart import merge

    with open(config_path) as f:
        base = yaml.safe_load(f) or {}
    settings = load_settings(**merge(base, json.loads(overrides_json)))
    ray.init(address=ray_address, namespace="fairserve", log_to_driver=False)
    app = build_app(settings, describe_model(settings.engine), redis_url)
    print("ready", flush=True)
    sys.stdin.readline()
    print("deploying", flush=True)
    serve.run(app, name=settings.app_name, route_prefix="/")
    print("redeployed", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
