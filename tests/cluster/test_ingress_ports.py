"""Ports a cluster's servers take on one machine (``cluster/ports.py``, ``cluster/ingress.py``):
all between Ray's worker ports and the kernel's ephemeral range, never handed out twice by one
process. A cluster's HAProxy and router ports come as one block of consecutive ports (picked
one by one from the ephemeral range, one pick fell inside another's range or went to an
outgoing connection before HAProxy bound it); a single port (Redis, metrics, admin) comes from
above the blocks (one from the ephemeral range was shared, through SO_REUSEPORT, with a Ray
gRPC server, and the admin API's client read HTTP/2 frames: "illegal request line")."""

from __future__ import annotations

import random
import shutil
import socket

from cluster.ingress import BLOCK, ROUTER_PORTS, ingress_env, ingress_files
from cluster.ports import END_PORT, FIRST_PORT, SINGLES, free_port, port_block
from cluster.settings import load_settings


def ports_of(env: dict[str, str]) -> set[int]:
    ports = {int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]), int(env["RAY_SERVE_HAPROXY_STATS_PORT"])}
    for kind in ("HTTP", "GRPC"):
        low = int(env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{kind}_PORT"])
        high = int(env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{kind}_PORT"])
        assert high - low == ROUTER_PORTS
        ports |= set(range(low, high + 1))
    return ports


def ephemeral_range() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    return range(low, high + 1)


def test_three_clusters_ports_are_disjoint_and_outside_ray_and_ephemeral_ranges() -> None:
    settings = load_settings(router={"ingress": "haproxy"})
    envs = [ingress_env(settings) for _ in range(3)]
    try:
        blocks = [ports_of(env) for env in envs]
        for ports in blocks:
            assert len(ports) == BLOCK
            assert min(ports) >= FIRST_PORT > 19_999 and max(ports) < SINGLES
            assert not ports & set(ephemeral_range())
        assert not blocks[0] & blocks[1] and not blocks[0] & blocks[2] \
            and not blocks[1] & blocks[2]
    finally:
        for env in envs:
            shutil.rmtree(ingress_files(env))


def test_a_block_holding_a_bound_port_is_passed_over() -> None:
    seed = 1234
    first = port_block(BLOCK, random.Random(seed))  # the block this seed tries first, now taken
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        # the next block this seed would try: hold a port in its middle
        starts = list(range(FIRST_PORT, SINGLES - BLOCK + 1, BLOCK))
        random.Random(seed).shuffle(starts)
        following = [s for s in starts if s != first][0]
        held.bind(("127.0.0.1", following + BLOCK // 2))
        held.listen()
        got = port_block(BLOCK, random.Random(seed))
    assert got not in (first, following)
    assert got in starts


def test_single_ports_are_never_handed_out_twice_nor_ephemeral_nor_in_use() -> None:
    seed = 99
    first = free_port(random.Random(seed))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        # the port this seed would try next after ``first``: bound by someone else now
        order = list(range(SINGLES, END_PORT))
        random.Random(seed).shuffle(order)
        following = next(p for p in order if p != first)
        held.bind(("127.0.0.1", following))
        got = free_port(random.Random(seed))
    many = {free_port() for _ in range(200)}
    assert got not in (first, following)
    assert len(many) == 200 and not many & {first, got}
    assert all(SINGLES <= p < END_PORT and p not in ephemeral_range() for p in many | {got})
