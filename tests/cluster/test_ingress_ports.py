"""A cluster's HAProxy and router ports (``cluster/ingress.py``) come as one block of
consecutive ports, all free, below the kernel's ephemeral range and above Ray's worker ports,
never handed out twice by one process: picked one by one from the ephemeral range, one pick
fell inside another's range or went to an outgoing connection before HAProxy bound it."""

from __future__ import annotations

import random
import shutil
import socket

from cluster.ingress import (
    BLOCK,
    END_PORT,
    FIRST_PORT,
    ROUTER_PORTS,
    ingress_env,
    ingress_files,
    port_block,
)
from cluster.settings import load_settings


def ports_of(env: dict[str, str]) -> set[int]:
    ports = {int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]), int(env["RAY_SERVE_HAPROXY_STATS_PORT"])}
    for kind in ("HTTP", "GRPC"):
        low = int(env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{kind}_PORT"])
        high = int(env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{kind}_PORT"])
        assert high - low == ROUTER_PORTS
        ports |= set(range(low, high + 1))
    return ports


def test_three_clusters_ports_are_disjoint_and_outside_ray_and_ephemeral_ranges() -> None:
    settings = load_settings(router={"ingress": "haproxy"})
    envs = [ingress_env(settings) for _ in range(3)]
    try:
        blocks = [ports_of(env) for env in envs]
        for ports in blocks:
            assert len(ports) == BLOCK
            assert min(ports) >= FIRST_PORT > 19_999 and max(ports) < END_PORT <= 32_768
        assert not blocks[0] & blocks[1] and not blocks[0] & blocks[2] \
            and not blocks[1] & blocks[2]
    finally:
        for env in envs:
            shutil.rmtree(ingress_files(env))


def test_a_block_holding_a_bound_port_is_passed_over() -> None:
    seed = 1234
    first = port_block(random.Random(seed))  # the block this seed tries first, now taken
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        # the next block this seed would try: hold a port in its middle
        starts = list(range(FIRST_PORT, END_PORT - BLOCK + 1, BLOCK))
        random.Random(seed).shuffle(starts)
        following = [s for s in starts if s != first][0]
        held.bind(("127.0.0.1", following + BLOCK // 2))
        held.listen()
        got = port_block(random.Random(seed))
    assert got not in (first, following)
    assert got in starts
