"""Autoscaling the model replicas on what actually waits: the Redis backlog, in tokens.

NOTE: Ray Serve's default policy scales on requests ongoing at the replicas, which the
dispatchers cap at the replicas' slots: a backlog of ten thousand requests in Redis looks the
same to it as a full batch. This policy instead estimates the drain time of all the work there
is — the tokens queued in every tenant's queue (prompt + expected output, the fair-share cost)
plus what the replicas still have to do for their running requests — at the replicas' measured
throughput, and asks for the replica count that drains it within ``target_drain_s``:

    desired = ceil((queued_tokens + in_flight_tokens) / (tokens_per_s_per_replica * target_drain_s))

bounded by ``[min_replicas, max_replicas]`` (never below 1 unless scale-to-zero is allowed, and
0 only when there is no work at all). A change must persist: scaling up waits until a higher
desire has held for ``upscale_delay_s``, down until a lower one has held for
``downscale_delay_s`` (a short burst does not flap); from zero it is immediate, since a request
is waiting. Throughput per replica is the replicas' own measure (tokens processed per second,
from ``record_autoscaling_stats``) while they are busy; before any is known, and while they are
idle, the last busy estimate (at first ``initial_tokens_per_s``).

``decide`` is the pure policy (tested on synthetic inputs); ``BacklogPolicy`` is the Ray Serve
custom policy class that feeds it from Redis and the replicas' metrics, logs each decision with
its inputs and writes it to Redis for ``/metrics``, ``fairserve status`` and ``top``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# a child of Ray Serve's logger: the decisions land in the Serve controller's log
logger = logging.getLogger("ray.serve.fairserve.autoscaling")

INFLIGHT_TOKENS = "inflight_tokens"  # the replica metrics of record_autoscaling_stats
TOKENS_PER_S = "tokens_per_s"
BACKLOG_READ_S = 0.5  # the policy runs every control loop (0.1 s); Redis is read at most this often
DECISION_TTL_S = 60
# the decisions' counters (a Prometheus counter): kept while the pool decides, gone a week after
# its model left the settings
DECISION_COUNTS_TTL_S = 7 * 24 * 3600


class AutoscaleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, le=1024, description="fewest replicas (0: scale to zero)")
    max_replicas: int = Field(4, ge=1, le=1024, description="most replicas")
    target_drain_s: float = Field(
        20.0, gt=0, description="the backlog (queued + in-flight tokens) should drain within this")
    upscale_delay_s: float = Field(
        2.0, ge=0, description="a higher replica count must be wanted this long before scaling up")
    downscale_delay_s: float = Field(
        30.0, ge=0, description="a lower count must be wanted this long before scaling down")
    allow_scale_to_zero: bool = Field(
        False, description="with min_replicas 0: no replica while nothing waits or runs")
    initial_tokens_per_s: float = Field(
        100.0, gt=0, description="tokens/s one replica is assumed to process before measured")
    metrics_interval_s: float = Field(0.5, gt=0, le=10,
                                      description="how often replicas report their metrics")

    @model_validator(mode="after")
    def _check(self) -> AutoscaleSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling: min_replicas ({self.min_replicas}) exceeds "
                             f"max_replicas ({self.max_replicas})")
        if self.min_replicas == 0 and not self.allow_scale_to_zero:
            raise ValueError("autoscaling: min_replicas is 0 but allow_scale_to_zero is false")
        return self

    @property
    def floor(self) -> int:
        return self.min_replicas if self.allow_scale_to_zero else max(1, self.min_replicas)


@dataclass(frozen=True, slots=True)
class ScalingInputs:
    now_s: float
    num_running: int  # replicas serving
    target: int  # the count asked for last
    queued_tokens: int
    queued_requests: int
    in_flight_tokens: float
    measured_tokens_per_s: float | None  # per busy replica; None: none busy


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    replicas: int
    desired: int  # before the delays
    tokens_per_s: float  # the per-replica estimate used
    drain_s: float  # estimated drain time at the current target
    reason: str


def decide(inputs: ScalingInputs, settings: AutoscaleSettings,
           state: dict[str, Any]) -> tuple[ScalingDecision, dict[str, Any]]:
    """The replica count for ``inputs``; ``state`` carries the estimate and delay timers."""
    state = dict(state)
    if inputs.measured_tokens_per_s is not None and inputs.measured_tokens_per_s > 0:
        state["tokens_per_s"] = inputs.measured_tokens_per_s
    per_replica = float(state.get("tokens_per_s", settings.initial_tokens_per_s))
    work = inputs.queued_tokens + max(0.0, inputs.in_flight_tokens)
    if work <= 0 and inputs.queued_requests == 0:
        desired = settings.floor
    else:
        desired = max(1, math.ceil(work / (per_replica * settings.target_drain_s)))
    desired = min(settings.max_replicas, max(settings.floor, desired))
    # at the replicas serving now: one lost with its node is capacity missing, not the target's
    drain_s = work / (per_replica * max(inputs.num_running, 1))

    target, reason = inputs.target, "steady"
    if desired > target:
        state.pop("down_since", None)
        since = state.setdefault("up_since", inputs.now_s)
        if target == 0:
            target, reason = desired, "scale from zero: work is waiting"
        elif inputs.now_s - since >= settings.upscale_delay_s:
            target, reason = desired, f"drain {drain_s:.1f} s > target {settings.target_drain_s} s"
        else:
            reason = "holding: upscale delay"
    elif desired < target:
        state.pop("up_since", None)
        since = state.setdefault("down_since", inputs.now_s)
        if inputs.now_s - since >= settings.downscale_delay_s:
            target, reason = desired, "backlog drained"
        else:
            reason = "holding: downscale delay"
    else:
        state.pop("up_since", None)
        state.pop("down_since", None)
    if target != inputs.target:
        state.pop("up_since", None)
        state.pop("down_since", None)
    return ScalingDecision(target, desired, per_replica, drain_s, reason), state


class BacklogPolicy:
    """Ray Serve custom autoscaling policy (``policy_function`` a class, ``policy_kwargs``:
    ``redis_url``, ``settings`` as a dict, and ``pool``: the queues of the model the deployment
    serves, "" the default model's). Called by the Serve controller every control loop with
    the deployment's ``AutoscalingContext``. Each model scales on its own backlog alone."""

    def __init__(self, redis_url: str, settings: dict[str, Any], pool: str = "") -> None:
        self.redis_url = redis_url
        self.pool = pool
        self.settings = AutoscaleSettings(**settings)
        self._client: Any = None
        self._backlog: tuple[int, int] = (0, 0)
        self._read_at = 0.0
        self._last: tuple[int, str, int] | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = time.time()
        queued_tokens, queued_requests = self._read_backlog(now)
        in_flight, measured = _replica_metrics(ctx.aggregated_metrics or {})
        inputs = ScalingInputs(now, ctx.current_num_replicas, ctx.target_num_replicas,
                               queued_tokens, queued_requests, in_flight, measured)
        decision, state = decide(inputs, self.settings, dict(ctx.policy_state or {}))
        # published on each change, and when a replica is lost or comes back
        if self._last != (decision.replicas, decision.reason, inputs.num_running):
            self._last = (decision.replicas, decision.reason, inputs.num_running)
            logger.info("autoscale %s: %d -> %d replicas (%s); queued %d tokens in %d requests, "
                        "in flight %.0f tokens, %.1f tokens/s per replica, drain target %.0f s",
                        ctx.deployment_name, inputs.target, decision.replicas, decision.reason,
                        queued_tokens, queued_requests, in_flight, decision.tokens_per_s,
                        self.settings.target_drain_s)
            self._publish(inputs, decision)
        return decision.replicas, state

    def _redis(self) -> Any:
        if self._client is None:
            from router.state.redis_client import sync_connect, with_env_password

            url = with_env_password(self.redis_url)  # the password never travels through Ray
            self._client = sync_connect(url, socket_timeout=1, socket_connect_timeout=1)
        return self._client

    def _read_backlog(self, now: float) -> tuple[int, int]:
        if now - self._read_at < BACKLOG_READ_S:
            return self._backlog
        from redis.exceptions import RedisError

        from router.state.scripts import Script, script_source

        self._read_at = now
        try:
            rows = [r for r in self._redis().eval(script_source(Script.BACKLOG), 0, "")
                    if r[1].decode() == self.pool]  # backlog.lua: tenant, pool, priority, ...
            self._backlog = (sum(int(r[4]) for r in rows), sum(int(r[3]) for r in rows))
        except (RedisError, OSError) as exc:  # keep the last reading; scaling must not stop
            logger.warning("autoscaler cannot read the backlog: %s", exc)
        return self._backlog

    def _publish(self, inputs: ScalingInputs, decision: ScalingDecision) -> None:
        from redis.exceptions import RedisError

        from router.state import keys

        record = {**asdict(inputs), **{f"decision_{k}": v for k, v in asdict(decision).items()}}
        try:
            pipe = self._redis().pipeline(transaction=False)
            pipe.set(keys.autoscaler(self.pool), json.dumps(record), ex=DECISION_TTL_S)
            counts = keys.autoscaler_decisions(self.pool)
            pipe.hincrby(counts, _direction(inputs.target, decision.replicas))
            pipe.expire(counts, DECISION_COUNTS_TTL_S)
            pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning("autoscaler cannot record its decision: %s", exc)


def _direction(before: int, after: int) -> str:
    return "up" if after > before else "down" if after < before else "hold"


def _replica_metrics(metrics: dict[str, dict[Any, float]]) -> tuple[float, float | None]:
    """In-flight tokens of all replicas; tokens/s per busy replica (None: none is busy)."""
    in_flight = sum(metrics.get(INFLIGHT_TOKENS, {}).values())
    rates = [r for replica, r in metrics.get(TOKENS_PER_S, {}).items()
             if r > 0 and metrics.get(INFLIGHT_TOKENS, {}).get(replica, 0) > 0]
    return in_flight, (sum(rates) / len(rates) if rates else None)
