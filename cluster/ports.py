"""Ports for the servers a cluster starts on one machine: its Redis, its routers, its ingress,
its metrics and admin ports where the settings leave them to be picked.

Every port comes from between Ray's worker ports (10002-19999 by default) and the kernel's
ephemeral range (32768+), and this process never hands one out twice. A port that ``bind(0)``
returned was free for a moment only: the ephemeral range is where outgoing connections and
every ``bind(0)`` of Ray's gRPC servers take theirs, and gRPC binds with SO_REUSEPORT, so a
server of ours binding the same port with SO_REUSEPORT (the metrics and admin servers do) would
share it without an error, and half its connections would reach a gRPC server ("illegal request
line").
"""

from __future__ import annotations

import random
import socket

FIRST_PORT, END_PORT = 20_000, 32_768
# Blocks of consecutive ports (a cluster's HAProxy and routers) come from below SINGLES, single
# ports from above, so single picks never break up the room for blocks.
SINGLES = 30_000
_taken: set[int] = set()  # every port this process handed out


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _take(starts: list[int], size: int, rng: random.Random | None) -> int:
    (rng or random.SystemRandom()).shuffle(starts)
    for start in starts:
        ports = range(start, start + size)
        if _taken.isdisjoint(ports) and all(_free(p) for p in ports):
            _taken.update(ports)
            return start
    raise RuntimeError(f"no {size} consecutive free ports in {starts and min(starts)}-"
                       f"{starts and max(starts) + size - 1}")


def port_block(size: int, rng: random.Random | None = None) -> int:
    """The first of ``size`` consecutive ports, all free now and never handed out before."""
    return _take(list(range(FIRST_PORT, SINGLES - size + 1, size)), size, rng)


def free_port(rng: random.Random | None = None) -> int:
    """A port that is free now and was never handed out before by this process."""
    return _take(list(range(SINGLES, END_PORT)), 1, rng)
