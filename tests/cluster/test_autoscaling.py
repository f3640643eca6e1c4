"""The backlog autoscaling policy on synthetic inputs, and as Ray Serve calls it (a real
``AutoscalingContext``, a real Redis backlog)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.app import autoscaling_config
from cluster.autoscaling import (
    DECISION_COUNTS_TTL_S,
    AutoscaleSettings,
    BacklogPolicy,
    ScalingInputs,
    _replica_metrics,
    decide,
)
from router.state import keys
from router.state.tenants import Tenant
from tests.router.factories import add_tenants, harness, make_request, run

S = AutoscaleSettings(min_replicas=1, max_replicas=4, target_drain_s=10.0, upscale_delay_s=2.0,
                      downscale_delay_s=30.0, initial_tokens_per_s=100.0)


def inputs(now: float, target: int, queued: int, in_flight: float = 0.0,
           measured: float | None = None) -> ScalingInputs:
    return ScalingInputs(now, target, target, queued, 1 if queued else 0, in_flight, measured)


def run_policy(steps: list[ScalingInputs], settings: AutoscaleSettings = S) -> list[int]:
    state: dict = {}
    out = []
    target = steps[0].target
    for step in steps:
        step = ScalingInputs(step.now_s, target, target, step.queued_tokens,
                             step.queued_requests, step.in_flight_tokens,
                             step.measured_tokens_per_s)
        decision, state = decide(step, settings, state)
        target = decision.replicas
        out.append(target)
    return out


def test_scales_up_once_the_drain_time_passes_the_target_for_the_delay() -> None:
    # 3,000 tokens at 100 tokens/s per replica: 3 replicas drain them in 10 s
    steps = [inputs(t, 1, 3000) for t in (0.0, 1.0, 1.9, 2.0, 2.5)]
    assert run_policy(steps) == [1, 1, 1, 3, 3]


def test_a_short_burst_does_not_scale() -> None:
    steps = [inputs(0.0, 1, 3000), inputs(1.0, 1, 3000), inputs(1.5, 1, 200),
             inputs(2.5, 1, 3000), inputs(4.0, 1, 3000), inputs(4.6, 1, 3000)]
    assert run_policy(steps) == [1, 1, 1, 1, 1, 3], "the delay restarts after the burst"


def test_scales_down_only_after_the_downscale_delay() -> None:
    steps = [inputs(0.0, 3, 0), inputs(10.0, 3, 0), inputs(29.9, 3, 0), inputs(30.0, 3, 0)]
    assert run_policy(steps) == [3, 3, 3, 1]


def test_respects_the_bounds_and_never_goes_below_one_without_scale_to_zero() -> None:
    assert run_policy([inputs(0.0, 1, 10**9), inputs(5.0, 1, 10**9)]) == [1, 4]
    idle = [inputs(float(t), 1, 0) for t in range(0, 100, 10)]
    assert set(run_policy(idle)) == {1}
    at_least_two = AutoscaleSettings(min_replicas=2, max_replicas=3, downscale_delay_s=0)
    assert run_policy([inputs(0.0, 3, 0), inputs(1.0, 2, 0)], at_least_two) == [2, 2]


def test_scale_to_zero_when_idle_and_straight_back_when_work_arrives() -> None:
    zero = AutoscaleSettings(min_replicas=0, max_replicas=2, allow_scale_to_zero=True,
                             downscale_delay_s=5.0, upscale_delay_s=3.0)
    steps = [inputs(0.0, 1, 0), inputs(4.0, 1, 0), inputs(5.0, 1, 0), inputs(6.0, 0, 50)]
    assert run_policy(steps, zero) == [1, 1, 0, 1], "from zero: no upscale delay"


def test_in_flight_work_counts_and_the_measured_throughput_is_kept() -> None:
    decision, state = decide(inputs(0.0, 2, 0, in_flight=1000.0, measured=50.0), S, {})
    assert decision.desired == 2 and decision.tokens_per_s == 50.0
    decision, state = decide(inputs(1.0, 2, 0, in_flight=1000.0, measured=None), S, state)
    assert decision.tokens_per_s == 50.0, "an idle moment keeps the last busy estimate"
    assert decision.drain_s == pytest.approx(1000 / (50 * 2))


def test_settings_refuse_contradictions() -> None:
    with pytest.raises(ValidationError, match="exceeds max_replicas"):
        AutoscaleSettings(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="allow_scale_to_zero"):
        AutoscaleSettings(min_replicas=0)


def test_replica_metrics_average_only_busy_replicas() -> None:
    metrics = {"inflight_tokens": {"a": 100.0, "b": 0.0, "c": 50.0},
               "tokens_per_s": {"a": 80.0, "b": 5.0, "c": 40.0}}
    assert _replica_metrics(metrics) == (150.0, 60.0)
    assert _replica_metrics({}) == (0.0, None)


def _context(num_replicas: int, target: int, metrics: dict, state: dict) -> AutoscalingContext:
    deployment = DeploymentID(name="ModelReplica", app_name="fairserve")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=deployment) for i in range(num_replicas)]
    return AutoscalingContext(
        deployment_id=deployment, deployment_name="ModelReplica", app_name="fairserve",
        current_num_replicas=num_replicas, target_num_replicas=target, running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics,
        raw_metrics={}, capacity_adjusted_min_replicas=0, capacity_adjusted_max_replicas=4,
        policy_state=state, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=AutoscalingConfig(min_replicas=0, max_replicas=4))


def test_the_ray_policy_reads_the_backlog_from_redis_and_records_its_decision(
        redis_server, redis_client) -> None:
    async def admit() -> None:
        async with harness(redis_server.url) as h:
            await add_tenants(h, Tenant(id="a"), Tenant(id="b", priority=1))
            for i in range(10):
                await h.queues.admit(make_request("a", f"a{i}", prompt_tokens=100, max_tokens=200))
            await h.queues.admit(make_request("b", "b0", prompt_tokens=100, max_tokens=200))
            for i in range(5):  # another model's: its own deployment scales on them
                await h.queues.admit(make_request("a", f"big{i}", prompt_tokens=100,
                                                  max_tokens=200, pool="big"))

    run(admit())  # 11 requests x 300 tokens = 3,300 queued tokens (and 1,500 of "big")
    settings = AutoscaleSettings(min_replicas=0, max_replicas=4, allow_scale_to_zero=True,
                                 target_drain_s=10.0, initial_tokens_per_s=100.0)
    policy = BacklogPolicy(redis_server.url, settings.model_dump())
    replicas, state = policy(_context(0, 0, {}, {}))
    assert replicas == 4, "from zero at once, as many as drain 3,300 tokens in 10 s (max 4)"
    record = json.loads(redis_client.get(keys.autoscaler()))
    assert record["queued_tokens"] == 3300 and record["queued_requests"] == 11
    assert record["decision_replicas"] == 4 and record["decision_reason"].startswith("scale from")
    assert redis_client.hget(keys.autoscaler_decisions(), "up") == b"1"
    assert 0 < redis_client.ttl(keys.autoscaler_decisions()) <= DECISION_COUNTS_TTL_S
    BacklogPolicy(redis_server.url, settings.model_dump(), pool="big")(_context(0, 0, {}, {}))
    record = json.loads(redis_client.get(keys.autoscaler("big")))
    assert record["queued_tokens"] == 1500 and record["queued_requests"] == 5

    metrics = {"inflight_tokens": {}, "tokens_per_s": {}}
    config = autoscaling_config(settings, redis_server.url)
    assert config["policy"]["policy_function"] == "cluster.autoscaling:BacklogPolicy"
    assert config["upscale_delay_s"] == config["downscale_delay_s"] == 0.0
    assert BacklogPolicy(**config["policy"]["policy_kwargs"]).settings == settings
    redis_client.flushall()
    policy._read_at = 0.0  # read again now
    replicas, state = policy(_context(4, 4, metrics, state))
    assert replicas == 4, "nothing waits, but the downscale delay has not passed"
