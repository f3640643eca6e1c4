"""A token source for benchmarks only: an ``Engine`` that does no model work.

It stands where the torch engine stands in a model replica, takes requests like it, and every
``step_s`` gives each running request one more token (a fixed id and text), so a benchmark can
drive the serving path (replica -> router -> Redis -> HTTP) at rates a CPU model cannot reach,
and measure what the path itself costs a token. It is named as what it is, reached only
through ``cluster.benchmarks.serving_path``'s engine factory, and never used by a correctness
test: its tokens mean nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

from replicas.engine.config import EngineConfig
from replicas.engine.interface import (
    CachedPrefix,
    Chunk,
    FinishReason,
    GenerateRequest,
    LoadSnapshot,
    Timings,
    Usage,
)

TOKEN_ID = 1000  # any id of the default vocabulary; its text is TOKEN_TEXT, not the model's
TOKEN_TEXT = " w"
NUM_BLOCKS = 4096
COMPUTE = "token source (benchmark only: no model)"


@dataclass(slots=True)
class _Running:
    request: GenerateRequest
    remaining: int
    num_sent: int
    arrived_s: float
    chunks: asyncio.Queue[Chunk] = field(default_factory=asyncio.Queue)
    first_token_s: float | None = None


class TokenSourceEngine:
    """One token per running request every ``step_s`` (0: as fast as the event loop turns)."""

    def __init__(self, config: EngineConfig, step_s: float = 0.01) -> None:
        self.config = config
        self.step_s = step_s
        self._running: dict[str, _Running] = {}
        self._num_steps = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._has_work = asyncio.Event()

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        if request.sampling.n != 1:
            raise ValueError("the token source serves one choice per request")
        sent = len(request.resume[0].token_ids) if request.resume else 0
        running = _Running(request, request.sampling.max_tokens - sent, sent, time.time())
        if running.remaining <= 0:
            return
        self._running[request.request_id] = running
        self._has_work.set()
        try:
            while True:
                chunk = await running.chunks.get()
                yield chunk
                if chunk.is_final:
                    return
        finally:
            self._running.pop(request.request_id, None)

    async def _step_loop(self) -> None:
        while True:
            if not self._running:
                self._has_work.clear()
                await self._has_work.wait()
            now = time.time()
            for running in list(self._running.values()):
                running.chunks.put_nowait(self._next_chunk(running, now))
            self._num_steps += 1
            await asyncio.sleep(self.step_s)

    def _next_chunk(self, running: _Running, now: float) -> Chunk:
        running.remaining -= 1
        running.num_sent += 1
        running.first_token_s = running.first_token_s or now
        request = running.request
        if running.remaining > 0:
            return Chunk(request.request_id, (TOKEN_ID,), TOKEN_TEXT)
        del self._running[request.request_id]
        num_prompt = len(request.prompt_token_ids or ())
        return Chunk(request.request_id, (TOKEN_ID,), TOKEN_TEXT, FinishReason.LENGTH,
                     usage=Usage(num_prompt, 0, running.num_sent),
                     timings=Timings(running.arrived_s, running.arrived_s,
                                     running.first_token_s, now))

    async def abort(self, request_id: str) -> bool:
        running = self._running.pop(request_id, None)
        if running is None:
            return False
        num_prompt = len(running.request.prompt_token_ids or ())
        now = time.time()
        running.chunks.put_nowait(Chunk(request_id, (), "", FinishReason.ABORT,
                                        usage=Usage(num_prompt, 0, running.num_sent),
                                        timings=Timings(running.arrived_s, running.arrived_s,
                                                        running.first_token_s, now)))
        return True

    def cached_prefix(self) -> CachedPrefix:
        return CachedPrefix()

    def load(self) -> LoadSnapshot:
        num_running = len(self._running)
        return LoadSnapshot(num_running, 0, NUM_BLOCKS, NUM_BLOCKS,
                            max(0, self.config.max_num_seqs - num_running),
                            num_steps=self._num_steps, progress=self._num_steps, compute=COMPUTE)

    async def check_health(self) -> None:
        return None

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()


def token_source_factory(step_s: float) -> partial[TokenSourceEngine]:
    """An engine factory for ``build_app`` (picklable: Ray ships it to the replica)."""
    return partial(TokenSourceEngine, step_s=step_s)
