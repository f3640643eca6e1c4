"""The load an engine reports (``LoadSnapshot``), from what vLLM exposes.

NOTE: vLLM's engine core sends a ``SchedulerStats`` (running and waiting requests, the
fraction of KV blocks in use) with each batch of outputs, to the stat loggers of its
``AsyncLLM``. ``SchedulerStatsRecorder`` is such a logger: it keeps the latest one and counts
them (one per engine step that produced output, so ``num_steps`` stops counting when the step
loop stops). The snapshot is an approximation of the torch engine's exact one:

- the stats are as of the last step, and a step runs only while requests do: after the last
  request ends or is aborted, vLLM sends no fresh stats. So with no vLLM request of this
  adapter in flight the snapshot says idle (nothing running, every block free), and otherwise
  running + waiting is capped at the requests in flight.
- free blocks = total x (1 - kv_cache_usage), total from vLLM's ``cache_config.num_gpu_blocks``.
  vLLM counts blocks that only the prefix cache holds as free, as the torch engine does.
- before the first stats arrive, requests in flight that have produced a token count as
  running and the rest as waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from replicas.engine.interface import LoadSnapshot


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """The fields of vLLM's ``SchedulerStats`` the snapshot needs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1


class SchedulerStatsRecorder:
    """A vLLM stat logger (the shape of ``vllm.v1.metrics.loggers.StatLoggerBase``, whose
    ``record`` signature changed between versions) that keeps the latest scheduler state."""

    def __init__(self) -> None:
        self.latest: SchedulerState | None = None
        self.num_records = 0
        self.last_record_s = time.monotonic()  # when the latest stats came

    def factory(self, vllm_config: object, engine_index: int = 0) -> SchedulerStatsRecorder:
        """vLLM's per-engine ``StatLoggerFactory``: (vllm_config, engine_index) -> logger."""
        return self

    def record(self, scheduler_stats: object, iteration_stats: object = None,
               *args: object, **kwargs: object) -> None:
        if scheduler_stats is None:
            return
        self.latest = SchedulerState(
            num_running=int(getattr(scheduler_stats, "num_running_reqs", 0)),
            num_waiting=int(getattr(scheduler_stats, "num_waiting_reqs", 0)),
            kv_cache_usage=float(getattr(scheduler_stats, "kv_cache_usage", 0.0)),
        )
        self.num_records += 1
        self.last_record_s = time.monotonic()

    def log_engine_initialized(self) -> None:
        """Part of vLLM's logger interface; nothing to log."""

    def log(self) -> None:
        """Part of vLLM's logger interface; nothing to log."""

    def record_sleep_state(self, *args: object, **kwargs: object) -> None:
        """Part of newer vLLM's logger interface; sleep mode is not used."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """This adapter's own count of vLLM requests (choices) it has sent and not seen end."""

    num_requests: int
    num_started: int  # of which have produced a token


def estimate_load(state: SchedulerState | None, in_flight: InFlight, num_total_blocks: int,
                  max_num_seqs: int, num_steps: int) -> LoadSnapshot:
    """The snapshot (see the module NOTE)."""
    if in_flight.num_requests == 0:
        running, waiting, used = 0, 0, 0
    elif state is None:
        running = in_flight.num_started
        waiting = in_flight.num_requests - in_flight.num_started
        used = 0
    else:
        running = min(state.num_running, in_flight.num_requests)
        waiting = min(state.num_waiting, in_flight.num_requests - running)
        usage = min(max(state.kv_cache_usage, 0.0), 1.0)
        used = round(num_total_blocks * usage)
    return LoadSnapshot(
        num_running=running,
        num_waiting=waiting,
        num_free_kv_blocks=num_total_blocks - used,
        num_total_kv_blocks=num_total_blocks,
        num_free_slots=max(0, max_num_seqs - running - waiting),
        num_steps=num_steps,
        progress=num_steps,  # vLLM's layers run out of sight: its steps are its progress
    )
