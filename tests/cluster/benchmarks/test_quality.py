"""The faster CPU configurations stay close to the float32 engine (cluster/benchmarks/quality.py):
token agreement and log-probability error on a fixed set of prompts, held to stated thresholds."""

from __future__ import annotations

import pytest

from cluster.benchmarks.quality import THRESHOLDS, answers, candidates, compare
from replicas.engine.config import DType, EngineConfig, Quantization
from replicas.torch_engine.device_choice import CPU_BF16_FLAGS, cpu_flags

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CPU_BF16_FLAGS & cpu_flags(),
                       reason="this CPU has no native bfloat16 (avx512_bf16, amx_bf16): bf16 and "
                              "int4 are emulated there, and not chosen by dtype auto"),
]
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def reference():
    return answers(EngineConfig(dtype=DType.FLOAT32, quantization=Quantization.NONE), NUM_TOKENS)


@pytest.mark.parametrize("name", sorted(THRESHOLDS))
def test_configuration_is_close_to_float32(reference, name: str) -> None:
    report = compare(name, reference, answers(candidates()[name], NUM_TOKENS))
    limit = THRESHOLDS[name]
    print(report)
    assert report.agreement >= limit.min_agreement, report
    assert report.logprob_error <= limit.max_logprob_error, report
    # not a vacuous pass: the answers are long enough to compare, and some agree outright
    assert report.num_exact >= 1, report


def test_the_measure_sees_a_broken_quantization(reference, monkeypatch) -> None:
    """int4 codes read with the wrong zero point (every weight shifted by 8 steps), a fault put
    into the real quantizer: the report must fail the thresholds, or they would pass anything."""
    from replicas.torch_engine.models import cpu_int4

    original = cpu_int4.quantize_groups

    def shifted(weight):
        codes, scale, zero = original(weight)
        return codes, scale, zero - 8 * scale

    monkeypatch.setattr(cpu_int4, "quantize_groups", shifted)
    broken = answers(candidates()["bfloat16 int4"], NUM_TOKENS)
    monkeypatch.undo()
    report = compare("broken", reference, broken)
    limit = THRESHOLDS["bfloat16 int4"]
    assert report.agreement < limit.min_agreement or report.logprob_error > limit.max_logprob_error
