"""``TorchEngine``: the async ``Engine`` that replicas use, over one engine thread.

NOTE: the model step is blocking torch work, so it runs on a dedicated thread that owns the
``EngineCore``. Callers on the event loop talk to it through a command queue (add, abort) and
get chunks back through one ``asyncio.Queue`` per request, fed once per step with
``call_soon_threadsafe``. Validation and tokenization happen on the caller's side, so a bad
request raises before anything reaches the engine thread. ``abort`` returns only after the
engine thread has freed the request's KV blocks. If the engine thread dies, every open stream
raises ``EngineDeadError`` and ``check_health`` fails.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import torch

from replicas.engine.config import EngineConfig
from replicas.engine.errors import EngineDeadError, InvalidRequestError
from replicas.engine.interface import CachedPrefix, Chunk, GenerateRequest, LoadSnapshot
from replicas.torch_engine.engine_core import EngineCore, PreparedRequest

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # the loop wakes this often with nothing to do, to notice shutdown
CACHED_PREFIX_PERIOD_S = 0.5  # how stale the cached-prefix snapshot may be (while it changes)
MAX_PUBLISHED_BLOCKS = 8192  # the most recently cached block hashes a replica publishes


@dataclass(slots=True)
class _Add:
    prepared: PreparedRequest
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue


@dataclass(slots=True)
class _Abort:
    request_id: str
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future = field(repr=False)


class TorchEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._core: EngineCore | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        # request id -> (its loop, its queue, the choices still to finish)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[int]]] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._load: LoadSnapshot | None = None
        self._last_step_s = time.monotonic()
        self._cached_prefix = CachedPrefix()
        self._cached_prefix_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the engine thread and start its loop.

        The model is built on the thread that runs it: torch steps measured ~1.4x slower on a
        thread other than the one that loaded the weights and set up the thread pools.
        """
        if self._thread is not None:
            return
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(loop, ready), name="fairserve-engine", daemon=True
        )
        self._thread.start()
        try:
            await ready
        except BaseException:
            self._thread.join()
            self._thread = None
            raise

    async def shutdown(self) -> None:
        """Abort every request (each stream gets its final ABORT chunk) and stop the loop."""
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineDeadError("the engine has not been started")
        return self._core

    # ---- the Engine API --------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        self._check_alive()
        # raises InvalidRequestError before scheduling; a grammar compiles off the event loop
        prepared = (self.core.prepare(request) if request.sampling.structured_output is None
                    else await asyncio.to_thread(self.core.prepare, request))
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(prepared, loop, sink))
        finished = False
        num_open = request.num_open_choices  # it ends with the last open choice's final chunk
        try:
            while True:
                item = await sink.get()
                if isinstance(item, InvalidRequestError):
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                yield item
                if item.is_final:
                    num_open -= 1
                    if num_open == 0:
                        finished = True
                        return
        finally:
            if not finished:  # the reader went away (disconnect, cancel): free the blocks
                await self._abort_quietly(request.request_id)

    async def abort(self, request_id: str) -> bool:
        self._check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(_Abort(request_id, loop, done))
        return await done

    def cached_prefix(self) -> CachedPrefix:
        return self._cached_prefix

    def load(self) -> LoadSnapshot:
        """The snapshot taken after the last step, with the engine's progress as of now (it
        moves during a long step, layer by layer: the dispatchers' sign that it is alive)."""
        if self._load is None or self._core is None:
            raise EngineDeadError("the engine has not been started")
        return replace(self._load, progress=self._core.progress)

    async def check_health(self) -> None:
        self._check_alive()
        load = self.load()
        stalled_s = time.monotonic() - self._last_step_s
        if (load.num_running or load.num_waiting) and stalled_s > self.config.max_queue_wait_s:
            raise EngineDeadError(f"the engine loop has made no progress for {stalled_s:.1f} s")

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")

    async def _abort_quietly(self, request_id: str) -> None:
        if self._error is None and self._thread is not None and self._thread.is_alive():
            await asyncio.shield(self.abort(request_id))

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future) -> None:
        try:
            if self.config.num_threads is not None:
                torch.set_num_threads(self.config.num_threads)
            core = self._core = EngineCore(self.config)
            self._load = core.load()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            loop.call_soon_threadsafe(_fail, ready, exc)
            return
        loop.call_soon_threadsafe(_resolve, ready, True)
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not core.has_unfinished)
                if core.has_unfinished:
                    chunks = core.step()
                    self._last_step_s = time.monotonic()
                    self._load = core.load()
                    self._deliver(chunks)
                    self._snapshot_cached_prefix(core)
                else:
                    self._last_step_s = time.monotonic()
                    self._snapshot_cached_prefix(core)
        except BaseException as exc:  # noqa: BLE001 - the loop's boundary: report, then stop
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(exc)
            return
        self._deliver(core.abort_all())
        self._load = core.load()

    def _snapshot_cached_prefix(self, core: EngineCore) -> None:
        """At most every ``CACHED_PREFIX_PERIOD_S``, in the engine thread (the only one that
        may read the block manager): the cached block hashes, for ``cached_prefix``."""
        now = time.monotonic()
        version = core.block_manager.cache_version
        if now - self._cached_prefix_s < CACHED_PREFIX_PERIOD_S \
                or version == self._cached_prefix.version:
            return
        self._cached_prefix_s = now
        self._cached_prefix = CachedPrefix(
            version, core.block_manager.cached_hashes(MAX_PUBLISHED_BLOCKS))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort) -> None:
        core = self.core
        if isinstance(command, _Add):
            request_id = command.prepared.request.request_id
            try:
                core.add(command.prepared)
            except InvalidRequestError as exc:  # a duplicate id: refuse this stream only
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
                return
            num_open = command.prepared.request.num_open_choices
            self._sinks[request_id] = (command.loop, command.sink, [num_open])
            self._load = core.load()
            return
        finals = core.abort(command.request_id)
        self._deliver(finals)
        self._load = core.load()
        command.loop.call_soon_threadsafe(_resolve, command.done, bool(finals))

    def _deliver(self, chunks: list[Chunk]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Chunk]]] = {}
        for chunk in chunks:
            target = self._sinks.get(chunk.request_id)
            if target is None:
                continue
            if chunk.is_final:
                target[2][0] -= 1
                if target[2][0] == 0:
                    del self._sinks[chunk.request_id]
            by_loop.setdefault(target[0], []).append((target[1], chunk))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        for loop, sink, _ in self._sinks.values():
            loop.call_soon_threadsafe(sink.put_nowait, exc)
        self._sinks.clear()
        while True:  # commands that raced with the crash get an answer too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
            elif isinstance(command, _Abort):
                command.loop.call_soon_threadsafe(_resolve, command.done, False)


def _put_all(items: list[tuple[asyncio.Queue, Chunk]]) -> None:
    for sink, chunk in items:
        sink.put_nowait(chunk)


def _resolve(future: asyncio.Future, value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
