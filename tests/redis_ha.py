"""Redis with replicas and Sentinel for tests: a primary, ``num_replicas`` replicas of it and
one Sentinel watching them (quorum 1), all the embedded ``redis-server`` binary on free ports,
killed when the test ends. Used by the Sentinel unit tests (tests/router/state) and the
failover chaos test (tests/chaos/test_redis_failover.py)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from cluster.ports import free_port
from cluster.redis_server import find_redis_server

SERVICE = "fs"
DOWN_AFTER_MS = 1_000  # Sentinel's down-after-milliseconds: a failover starts this long after


@dataclass
class Servers:
    primary: subprocess.Popen[bytes]
    primary_port: int
    replica_ports: list[int]
    sentinel_port: int
    by_port: dict[int, subprocess.Popen[bytes]]  # the data servers

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    @property
    def replica_port(self) -> int:
        return self.replica_ports[0]

    def replicas_online(self) -> int:
        """How many replicas the primary Sentinel names now has in sync (``WAIT`` counts
        them: an admission with ``replicas_to_ack`` waits for one)."""
        primary = redis.Redis(port=self.primary_now(), socket_timeout=2)
        try:
            info = primary.info("replication")
            return sum(1 for k, v in info.items() if k.startswith("slave") and
                       isinstance(v, dict) and v.get("state") == "online")
        finally:
            primary.close()

    def primary_now(self) -> int:
        """The port of the primary Sentinel names now."""
        sentinel = redis.Redis(port=self.sentinel_port, socket_timeout=2)
        try:
            return int(sentinel.sentinel_get_master_addr_by_name(SERVICE)[1])
        finally:
            sentinel.close()


def _server(binary: str, directory: Path, *args: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([binary, *args, "--dir", str(directory), "--logfile",
                             str(directory / "redis.log")], stdin=subprocess.DEVNULL)


def _is_down(state: dict) -> bool:
    return bool(state.get("is_sdown") or state.get("is_odown") or not state.get("is_master"))


def wait_until(what: str, check: Callable[[], object], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout_s} s ({last})")


@contextlib.contextmanager
def sentinel_servers(directory: Path, num_replicas: int = 1) -> Iterator[Servers]:
    binary = find_redis_server()
    primary_port, sentinel_port = free_port(), free_port()
    replica_ports = [free_port() for _ in range(num_replicas)]
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    processes = [_server(binary, directory / "primary", "--port", str(primary_port), *common)]
    for i, port in enumerate(replica_ports):
        processes.append(_server(binary, directory / f"replica{i}", "--port", str(port), *common,
                                 "--replicaof", "127.0.0.1", str(primary_port)))
    (directory / "sentinel").mkdir(parents=True)
    config = directory / "sentinel" / "sentinel.conf"
    config.write_text(f"port {sentinel_port}\nbind 127.0.0.1\n"
                      f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n"
                      f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                      f"sentinel failover-timeout {SERVICE} 5000\n")
    processes.append(subprocess.Popen([binary, str(config), "--sentinel", "--logfile",
                                       str(directory / "sentinel" / "sentinel.log")],
                                      stdin=subprocess.DEVNULL))
    try:
        for port in replica_ports:
            replica = redis.Redis(port=port)
            wait_until("the replica's link to the primary",
                       lambda r=replica: r.info("replication")["master_link_status"] == "up")
        sentinel = redis.Redis(port=sentinel_port)
        wait_until("the sentinel's view of the replicas",
                   lambda: len(sentinel.sentinel_slaves(SERVICE)) == num_replicas)
        # and of the primary, up: a client asking for it meanwhile finds no master (a primary
        # slow to answer for DOWN_AFTER_MS under the suite's load is marked down until it does)
        wait_until("the sentinel's view of the primary, up",
                   lambda: not _is_down(sentinel.sentinel_master(SERVICE)))
        data_servers = dict(zip([primary_port, *replica_ports], processes, strict=False))
        yield Servers(processes[0], primary_port, replica_ports, sentinel_port, data_servers)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
