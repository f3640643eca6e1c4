"""The replica report's one codec: every kind of report comes back equal after the round trip
Ray gives it (plain sequences, tuples returned as lists), and says what it is."""

from __future__ import annotations

import json

import pytest

from replicas.protocol import (
    CallReport,
    CallSampling,
    ChunkTimings,
    ChunkUsage,
    Halt,
    ReplicaLoad,
)

REPORTS = [
    CallReport("r1"),  # the replica saying it has the call
    CallReport(),  # alive
    CallReport("r1", 2, "length", 9, ChunkUsage(5, 6, 7),
               ChunkTimings(1.0, 1.5, 2.0, 3.0, 2, 1)),
    CallReport("r1", 0, "stop", 3, None, ChunkTimings(1.0, None, None, 3.0)),
    CallReport(halted=Halt.LEASE_LOST),
]


@pytest.mark.parametrize("report", REPORTS)
def test_a_report_survives_the_round_trip(report: CallReport) -> None:
    wire = json.loads(json.dumps(report.encode()))  # tuples come back as lists, as over Ray
    assert CallReport.decode(wire) == report


def test_the_router_s_sampling_json_reads_back_typed() -> None:
    from replicas.server import _sampling_params
    from router.api.openai_models import ChatCompletionRequest
    from router.api.sampling import sampling_wire

    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
        "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 3, "n": 2,
        "stop": ["x", "yz"], "stop_token_ids": [5], "include_stop_str_in_output": True,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "skip_special_tokens": False,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
        "logit_bias": {"17": -5}, "min_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object"}}}})
    wire = json.loads(json.dumps(sampling_wire(request, 9)))  # as stored in Redis
    sampling = CallSampling.from_wire(wire)
    assert sampling.stop == ("x", "yz") and sampling.logit_bias == ((17, -5.0),)
    assert sampling.structured_output is not None
    assert sampling.structured_output.kind == "json_schema"
    params = _sampling_params(sampling)
    assert (params.n, params.top_k, params.seed, params.max_tokens) == (2, 4, 3, 9)
    assert params.structured_output is not None and params.top_logprobs == 2
    with pytest.raises(TypeError):
        CallSampling.from_wire({"max_tokens": 4, "best_of": 2})


def test_the_engine_refuses_a_stop_string_over_the_shared_cap() -> None:
    from replicas.engine.errors import InvalidRequestError
    from replicas.engine.sampling_params import SamplingParams
    from replicas.protocol import MAX_STOP_STRING_CHARS

    SamplingParams(stop=("x" * MAX_STOP_STRING_CHARS,))
    with pytest.raises(InvalidRequestError, match="stop string"):
        SamplingParams(stop=("x" * (MAX_STOP_STRING_CHARS + 1),))


def test_a_load_report_reads_back_and_one_without_progress_counts_its_steps() -> None:
    load = ReplicaLoad("rep-1", 4, 1, 1, 0, 10, 8, 2.5, 123, num_steps=5, progress=155,
                       adapters=("a",), model="m")
    assert ReplicaLoad.from_json(load.to_json()) == load
    # a replica still on a release before progress (a rolling upgrade) publishes no such field:
    # its steps stand for it, so a busy one is not taken for a hung one while it steps
    old = json.loads(load.to_json())
    del old["progress"]
    assert ReplicaLoad.from_json(json.dumps(old)).progress == 5
