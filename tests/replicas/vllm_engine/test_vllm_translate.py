"""The vLLM adapter's translation between fairserve's records and vLLM's, without vLLM.

These tests check translation, not vLLM: the functions under test read the documented
attributes of vLLM's records (``RequestOutput``, ``CompletionOutput``, ``Logprob``,
``RequestStateStats``, ``SchedulerStats``) and recognise its exceptions by class name, so the
small records and exception classes here are built to that documented shape (as of vLLM 0.10.0
and 0.34.0). Whether vLLM itself behaves as documented is for ``test_vllm_contract.py``, which
runs the real engine on a GPU machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from dataclasses import dataclass

import pydantic
import pytest

from replicas.engine.config import DType, EngineConfig, VLLMOptions
from replicas.engine.errors import EngineDeadError, EngineError, InvalidRequestError, ModelLoadError
from replicas.engine.interface import ChoiceResume, Engine, FinishReason, GenerateRequest
from replicas.engine.sampling_params import GuideKind, SamplingParams, StructuredOutput
from replicas.vllm_engine import VLLMEngine, engine_args_kwargs, load_tokenizer
from replicas.vllm_engine.admission import ModelLimits, check_request
from replicas.vllm_engine.engine_args import lora_args
from replicas.vllm_engine.error_map import map_vllm_error
from replicas.vllm_engine.load import (
    InFlight,
    SchedulerState,
    SchedulerStatsRecorder,
    estimate_load,
)
from replicas.vllm_engine.outputs import (
    ChoiceStream,
    ClockReading,
    chunks_from_output,
    finish_reason,
    token_logprobs,
)
from replicas.vllm_engine.resume import plan_choices
from replicas.vllm_engine.sampling import (
    SEED_MODULUS,
    choice_kwargs,
    sampling_kwargs,
    structured_constraint,
    vllm_seed,
)

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


# ---- records in the documented shape of vLLM's -----------------------------------------------


@dataclass
class LogprobRecord:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None


@dataclass
class CompletionRecord:  # vllm.outputs.CompletionOutput, delta mode
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, LogprobRecord]] | None = None
    finish_reason: str | None = None


@dataclass
class StatsRecord:  # vllm.v1.metrics.stats.RequestStateStats: monotonic engine-core stamps
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_preemptions: int = 0  # newer vLLM (0.34); 0.10 has none


@dataclass
class OutputRecord:  # vllm.outputs.RequestOutput
    request_id: str
    outputs: list[CompletionRecord]
    finished: bool = False
    num_cached_tokens: int | None = None
    metrics: StatsRecord | None = None


# vLLM's exception hierarchy, by name (vllm/exceptions.py, vllm/v1/engine/exceptions.py)
VLLMClientError = type("VLLMClientError", (Exception,), {})
VLLMValidationError = type("VLLMValidationError", (VLLMClientError,), {})
VLLMServerError = type("VLLMServerError", (Exception,), {})
VLLMEngineDeadError = type("EngineDeadError", (VLLMServerError,), {})  # ours shares the name
EngineGenerateError = type("EngineGenerateError", (VLLMServerError,), {})


def validation_error(message: str, parameter: str) -> Exception:
    exc = VLLMValidationError(message)
    exc.parameter = parameter  # type: ignore[attr-defined]
    return exc


# a wall clock 1000 s ahead of the monotonic clock
CLOCK = ClockReading(wall_s=2000.0, monotonic_s=1000.0)


def make_stream(index: int = 0, **kwargs: object) -> ChoiceStream:
    values: dict[str, object] = dict(request_id="r", index=index, num_prompt_tokens=40,
                                     num_engine_prompt_tokens=40, arrived_s=1990.0,
                                     max_num_batched_tokens=16)
    values.update(kwargs)
    return ChoiceStream(**values)  # type: ignore[arg-type]


def completion(token_ids: list[int], text: str = "", reason: str | None = None,
               index: int = 0, logprobs: list[dict[int, LogprobRecord]] | None = None
               ) -> CompletionRecord:
    return CompletionRecord(index, text, token_ids, logprobs, reason)


# ---- sampling ----------------------------------------------------------------------------------


def test_every_sampling_field_maps_to_vllm_s_keyword() -> None:
    params = SamplingParams(
        max_tokens=50, min_tokens=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
        seed=11, n=2, stop=("END", "\n\n"), stop_token_ids=(7, 9),
        include_stop_str_in_output=True, ignore_eos=True, logprobs=True, top_logprobs=4,
        skip_special_tokens=False, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.3, logit_bias=((5, -100.0), (6, 2.5)))
    got = sampling_kwargs(params)
    assert got.kwargs == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 11,
        "max_tokens": 50, "min_tokens": 3, "stop": ["END", "\n\n"], "stop_token_ids": [7, 9],
        "include_stop_str_in_output": True, "ignore_eos": True, "logprobs": 4,
        "skip_special_tokens": False, "repetition_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": -0.3, "logit_bias": {5: -100.0, 6: 2.5},
    }
    assert got.constraint is None


def test_defaults_map_to_vllm_s_defaults_top_k_0_is_off_and_logprobs_off_is_none() -> None:
    got = sampling_kwargs(SamplingParams()).kwargs
    assert got["top_k"] == 0  # vLLM >= 0.10: 0 (its default) or -1 is off
    assert got["logprobs"] is None and got["logit_bias"] is None and got["seed"] is None
    assert got["stop"] == [] and got["stop_token_ids"] == []
    repeated = SamplingParams(logit_bias=((5, 1.0), (5, -2.0)))
    assert sampling_kwargs(repeated).kwargs["logit_bias"] == {5: -2.0}  # the later one wins
    assert sampling_kwargs(SamplingParams(logprobs=True)).kwargs["logprobs"] == 0  # no top
    assert sampling_kwargs(SamplingParams(logprobs=True, top_logprobs=20)).kwargs["logprobs"] == 20


@pytest.mark.parametrize("seed, expected", [
    (None, None), (0, 0), (1234, 1234), (-1, SEED_MODULUS - 1), (-(2**63), 2**63),
    (2**64 - 1, 2**64 - 1)])
def test_seeds_reduce_modulo_2_64_so_minus_1_stays_a_seed(seed: int | None,
                                                          expected: int | None) -> None:
    assert vllm_seed(seed) == expected


def test_structured_outputs_become_vllm_constraints() -> None:
    assert structured_constraint(None) is None
    assert structured_constraint(StructuredOutput(GuideKind.JSON_OBJECT)) == {"json_object": True}
    spec = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(PERSON))
    assert structured_constraint(spec) == {"json": PERSON}
    got = sampling_kwargs(SamplingParams(structured_output=spec))
    assert got.constraint == {"json": PERSON} and "structured_outputs" not in got.kwargs
    calls = json.dumps({"type": "array", "minItems": 1, "items": {"type": "object"}})
    grammar = structured_constraint(StructuredOutput(GuideKind.TOOL_CALLS, calls))["grammar"]
    assert grammar.startswith('start: "<tool_call>" calls "</tool_call>"')  # a forced tool call


@pytest.mark.parametrize("schema", ["{not json", "[1, 2]", '"a string"', ""])
def test_a_schema_that_is_not_a_json_object_is_refused_naming_response_format(schema: str
                                                                              ) -> None:
    with pytest.raises(InvalidRequestError) as err:
        structured_constraint(StructuredOutput(GuideKind.JSON_SCHEMA, schema))
    assert err.value.param == "response_format"


def test_each_choice_is_one_vllm_request_seeded_seed_plus_index() -> None:
    params = SamplingParams(n=3, seed=100, temperature=1.0, max_tokens=20, min_tokens=5)
    for index in range(3):
        got = choice_kwargs(params, index)
        assert got.kwargs["n"] == 1 and got.kwargs["seed"] == 100 + index
        assert got.kwargs["max_tokens"] == 20 and got.kwargs["min_tokens"] == 5
    unseeded = choice_kwargs(SamplingParams(n=2, temperature=1.0), 1)
    assert unseeded.kwargs["seed"] is None
    # greedy n > 1, which vLLM refuses as one request, is n requests of n=1
    assert choice_kwargs(SamplingParams(n=4, temperature=0.0), 3).kwargs["n"] == 1
    params = SamplingParams(n=3, seed=2**64 - 2, temperature=1.0)  # seeds wrap at 2**64
    assert [choice_kwargs(params, i).kwargs["seed"] for i in range(3)] == [2**64 - 2,
                                                                          2**64 - 1, 0]


def test_resumed_tokens_come_off_max_tokens_and_min_tokens() -> None:
    params = SamplingParams(max_tokens=24, min_tokens=10, temperature=0.0)
    got = choice_kwargs(params, 0, num_resumed_tokens=9)
    assert got.kwargs["max_tokens"] == 15 and got.kwargs["min_tokens"] == 1
    got = choice_kwargs(params, 0, num_resumed_tokens=12)
    assert got.kwargs["max_tokens"] == 12 and got.kwargs["min_tokens"] == 0


@pytest.mark.parametrize("index, resumed", [(-1, 0), (2, 0), (0, 24), (0, -1)])
def test_choice_kwargs_refuses_a_choice_that_is_not_there_or_has_no_room(index: int,
                                                                         resumed: int) -> None:
    with pytest.raises(ValueError):
        choice_kwargs(SamplingParams(n=2, max_tokens=24, temperature=1.0), index, resumed)


# ---- outputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("reason, expected", [
    (None, None), ("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
    ("abort", FinishReason.ABORT), ("repetition", FinishReason.STOP)])
def test_finish_reasons_map(reason: str | None, expected: FinishReason | None) -> None:
    assert finish_reason(reason) is expected


@pytest.mark.parametrize("reason", ["error", "bogus"])
def test_an_error_finish_raises_instead_of_ending(reason: str) -> None:
    with pytest.raises(EngineError):
        finish_reason(reason)


def test_deltas_stream_as_chunks_and_the_final_has_usage() -> None:
    stream = make_stream()
    streams = {0: stream}
    first = chunks_from_output(OutputRecord("r", [completion([11, 12], "Hel")]), streams, CLOCK)
    assert len(first) == 1 and first[0].token_ids == (11, 12) and first[0].text == "Hel"
    assert not first[0].is_final and first[0].usage is None and first[0].logprobs is None
    final = chunks_from_output(OutputRecord("r", [completion([13], "lo", "stop")],
                                            finished=True, num_cached_tokens=32), streams,
                               CLOCK)[0]
    assert final.finish_reason is FinishReason.STOP and final.text == "lo"
    assert final.usage is not None
    assert (final.usage.num_prompt_tokens, final.usage.num_cached_tokens,
            final.usage.num_output_tokens) == (40, 32, 3)
    assert stream.is_finished
    stream = make_stream()  # an empty delta makes no chunk, an empty final does
    assert chunks_from_output(OutputRecord("r", [completion([], "")]), {0: stream}, CLOCK) == []
    final = chunks_from_output(OutputRecord("r", [completion([], "", "length")]), {0: stream},
                               CLOCK)
    assert final[0].finish_reason is FinishReason.LENGTH and final[0].token_ids == ()


def test_n_choices_keep_their_index() -> None:
    streams = {i: make_stream(index=i) for i in range(3)}
    output = OutputRecord("r", [completion([1], "a", index=2), completion([2], "b", index=0),
                                completion([3], "c", "stop", index=1)])
    chunks = chunks_from_output(output, streams, CLOCK)
    assert [(c.index, c.token_ids, c.is_final) for c in chunks] == [
        (2, (1,), False), (0, (2,), False), (1, (3,), True)]
    with pytest.raises(EngineError):
        chunks_from_output(OutputRecord("r", [completion([4], index=5)]), streams, CLOCK)
    alone = make_stream(index=4)  # choice 4 of a request, run as its own vLLM request
    chunk = chunks_from_output(OutputRecord("r/4", [completion([9], "x")]), {0: alone}, CLOCK)
    assert chunk[0].index == 4 and chunk[0].request_id == "r"


def test_timings_come_from_monotonic_stamps_on_the_wall_clock() -> None:
    stats = StatsRecord(scheduled_ts=992.0, first_token_ts=993.0, last_token_ts=999.0,
                        num_preemptions=2)
    stream = make_stream()
    out = OutputRecord("r", [completion([1], "a", "length")], metrics=stats,
                       num_cached_tokens=0)
    timings = chunks_from_output(out, {0: stream}, CLOCK)[0].timings
    assert timings is not None
    assert timings.arrived_s == 1990.0  # fairserve's arrival, before vLLM's
    assert timings.first_scheduled_s == pytest.approx(1992.0)
    assert timings.first_token_s == pytest.approx(1993.0)
    assert timings.finished_s == 2000.0
    assert timings.num_preemptions == 2
    assert timings.num_prefill_chunks == math.ceil(40 / 16)
    assert CLOCK.to_wall(1000.0) == 2000.0 and CLOCK.to_wall(990.5) == 1990.5
    now = ClockReading.now()
    assert abs(now.to_wall(now.monotonic_s) - now.wall_s) < 1e-9


def test_timings_stay_ordered_when_the_clocks_disagree() -> None:
    # a wall clock stepped back: vLLM's stamps land before fairserve's arrival
    stats = StatsRecord(scheduled_ts=900.0, first_token_ts=950.0)
    stream = make_stream(arrived_s=1995.0)
    out = OutputRecord("r", [completion([1], "a", "stop")], metrics=stats)
    t = chunks_from_output(out, {0: stream}, ClockReading(wall_s=1960.0, monotonic_s=1000.0))[0]
    timings = t.timings
    assert timings is not None and timings.first_scheduled_s is not None
    assert timings.first_token_s is not None
    assert (timings.arrived_s <= timings.first_scheduled_s <= timings.first_token_s
            <= timings.finished_s)


def test_without_vllm_stats_the_first_token_is_when_it_was_seen() -> None:
    stream = make_stream()
    chunks_from_output(OutputRecord("r", [completion([1], "a")]), {0: stream},
                       ClockReading(1995.0, 995.0))
    final = chunks_from_output(OutputRecord("r", [completion([2], "b", "stop")]), {0: stream},
                               CLOCK)[0]
    assert final.timings is not None
    assert final.timings.first_scheduled_s is None and final.timings.first_token_s == 1995.0
    assert final.timings.num_preemptions == 0
    stream = make_stream(num_engine_prompt_tokens=100, max_num_batched_tokens=32)
    out = OutputRecord("r", [completion([1], "a", "stop")], num_cached_tokens=64)
    final = chunks_from_output(out, {0: stream}, CLOCK)[0]
    assert final.timings is not None and final.timings.num_prefill_chunks == 2  # ceil(36/32)


def test_a_resumed_choice_counts_its_resumed_tokens_as_output_not_prompt() -> None:
    stream = make_stream(num_prompt_tokens=40, num_engine_prompt_tokens=49, num_resumed_tokens=9,
                         pending_text="lo w")
    first = chunks_from_output(OutputRecord("r", [completion([5], "orld")]), {0: stream}, CLOCK)
    assert first[0].text == "lo world"  # the held-back text leads
    final = chunks_from_output(OutputRecord("r", [completion([6], "!", "length")],
                                            num_cached_tokens=48), {0: stream}, CLOCK)[0]
    assert final.text == "!" and final.usage is not None
    assert final.usage.num_output_tokens == 11
    assert final.usage.num_cached_tokens == 40  # cached resumed tokens are not prompt


def test_end_chunks_carry_pending_text_usage_and_timings() -> None:
    stream = make_stream(num_resumed_tokens=24, pending_text="tail")
    chunk = stream.end_chunk(FinishReason.LENGTH, CLOCK)
    assert chunk.finish_reason is FinishReason.LENGTH and chunk.text == "tail"
    assert chunk.usage is not None and chunk.usage.num_output_tokens == 24
    assert chunk.timings is not None and chunk.timings.first_token_s is None
    assert chunk.timings.num_prefill_chunks == 0
    aborted = make_stream()
    chunks_from_output(OutputRecord("r", [completion([1, 2], "ab")]), {0: aborted}, CLOCK)
    chunk = aborted.end_chunk(FinishReason.ABORT, CLOCK)
    assert chunk.finish_reason is FinishReason.ABORT and chunk.token_ids == ()
    assert chunk.usage is not None and chunk.usage.num_output_tokens == 2


def test_logprobs_keep_the_sampled_token_and_the_ranked_alternatives() -> None:
    positions = [
        {7: LogprobRecord(-0.1, 1), 8: LogprobRecord(-2.5, 2), 9: LogprobRecord(-3.0, 3)},
        # the sampled token ranks 5th: it is given, but is no top alternative
        {3: LogprobRecord(-4.0, 5), 1: LogprobRecord(-1.5, 2), 2: LogprobRecord(-0.5, 1)},
    ]
    got = token_logprobs([7, 3], positions, num_top=2)
    assert got[0].token_id == 7 and got[0].logprob == -0.1
    assert got[0].top == ((7, -0.1), (8, -2.5))
    assert got[1].token_id == 3 and got[1].logprob == -4.0
    assert got[1].top == ((2, -0.5), (1, -1.5))
    none = token_logprobs([7], positions[:1], num_top=0)
    assert none[0].top == () and none[0].logprob == -0.1


def test_logprobs_go_on_chunks_only_when_asked() -> None:
    position = {4: LogprobRecord(-0.2, 1), 5: LogprobRecord(-1.9, 2)}
    asked = make_stream(num_top_logprobs=1)
    chunk = chunks_from_output(OutputRecord("r", [completion([4], "x", logprobs=[position])]),
                               {0: asked}, CLOCK)[0]
    assert chunk.logprobs is not None and chunk.logprobs[0].top == ((4, -0.2),)
    plain = make_stream()
    chunk = chunks_from_output(OutputRecord("r", [completion([4], "x", logprobs=[position])]),
                               {0: plain}, CLOCK)[0]
    assert chunk.logprobs is None


def test_missing_logprobs_are_an_engine_error() -> None:
    with pytest.raises(EngineError):
        token_logprobs([1, 2], [{1: LogprobRecord(-0.1, 1)}], num_top=0)
    with pytest.raises(EngineError):
        token_logprobs([1], None, num_top=0)
    with pytest.raises(EngineError):
        token_logprobs([1], [{2: LogprobRecord(-0.1, 1)}], num_top=1)
    assert token_logprobs([], None, num_top=3) == ()


# ---- resume ----------------------------------------------------------------------------------


def text_of(token_ids: tuple[int, ...]) -> str:
    """A stand-in detokenizer for the arithmetic: token t is the letter chr(96 + t)."""
    return "".join(chr(96 + t) for t in token_ids)


def test_resume_arithmetic() -> None:
    fresh = GenerateRequest("r", SamplingParams(n=3, temperature=1.0), prompt_token_ids=(1, 2))
    assert [(p.index, p.prompt_token_ids, p.num_resumed_tokens)
            for p in plan_choices(fresh, [1, 2], 100, text_of)] == [
        (0, (1, 2), 0), (1, (1, 2), 0), (2, (1, 2), 0)]
    resume = (ChoiceResume(0, (3, 4, 5), num_text_chars_sent=2),
              ChoiceResume(1, is_finished=True),
              ChoiceResume(2, (), 0))
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=10)
    request = GenerateRequest("r", sampling, prompt_token_ids=(1, 2), resume=resume)
    plans = plan_choices(request, [1, 2], 100, text_of)
    assert [p.index for p in plans] == [0, 2]  # the finished choice does not run again
    first = plans[0]
    assert first.prompt_token_ids == (1, 2, 3, 4, 5) and first.resumed_token_ids == (3, 4, 5)
    assert first.pending_text == "e" and not first.is_exhausted  # "cde", 2 chars sent
    assert plans[1].prompt_token_ids == (1, 2) and plans[1].pending_text == ""
    kwargs = choice_kwargs(sampling, first.index, first.num_resumed_tokens).kwargs
    assert kwargs["max_tokens"] == 7
    every_token = GenerateRequest("r", SamplingParams(max_tokens=2), prompt_token_ids=(1,),
                                  resume=(ChoiceResume(0, (3, 4), num_text_chars_sent=99),))
    (plan,) = plan_choices(every_token, [1], 100, text_of)
    assert plan.is_exhausted and plan.pending_text == ""  # it ends at once


@pytest.mark.parametrize("resume", [
    (ChoiceResume(2, (3,)),),  # no such choice
    (ChoiceResume(0, (100,)),),  # token out of the vocabulary
    (ChoiceResume(0, (1, 2, 3)),),  # more than max_tokens
    (ChoiceResume(0, is_finished=True), ChoiceResume(1, is_finished=True)),  # nothing open
])
def test_a_bad_resume_is_refused_naming_resume(resume: tuple[ChoiceResume, ...]) -> None:
    request = GenerateRequest("r", SamplingParams(n=2, max_tokens=2, temperature=1.0),
                              prompt_token_ids=(1,), resume=resume)
    with pytest.raises(InvalidRequestError) as err:
        plan_choices(request, [1], 100, text_of)
    assert err.value.param == "resume"


def test_a_structured_choice_cannot_resume_part_way() -> None:
    spec = StructuredOutput(GuideKind.JSON_OBJECT)
    sampling = SamplingParams(n=2, temperature=0.0, structured_output=spec)
    part_way = GenerateRequest("r", sampling, prompt_token_ids=(1,),
                               resume=(ChoiceResume(0, (3, 4), 2),))
    with pytest.raises(EngineError) as err:
        plan_choices(part_way, [1], 100, text_of)
    assert not isinstance(err.value, InvalidRequestError)
    finished = GenerateRequest("r", sampling, prompt_token_ids=(1,),
                               resume=(ChoiceResume(0, (3, 4), 2, is_finished=True),))
    assert [p.index for p in plan_choices(finished, [1], 100, text_of)] == [1]


# ---- admission -------------------------------------------------------------------------------

LIMITS = ModelLimits(vocab_size=1000, max_model_len=64, max_num_seqs=4)


@pytest.mark.parametrize("request_, prompt, param", [
    (GenerateRequest("r", prompt=""), [], "prompt"),
    (GenerateRequest("r", messages=({"role": "user", "content": ""},)), [], "messages"),
    (GenerateRequest("r", prompt_token_ids=(1000,)), [1000], "prompt"),
    (GenerateRequest("r", SamplingParams(max_tokens=60), prompt_token_ids=(1,) * 5), [1] * 5,
     "max_tokens"),
    (GenerateRequest("r", SamplingParams(logit_bias=((1000, 1.0),)), prompt_token_ids=(1,)),
     [1], "logit_bias"),
    (GenerateRequest("r", SamplingParams(n=5, temperature=1.0), prompt_token_ids=(1,)), [1],
     "n"),
], ids=["empty-prompt", "empty-messages", "vocab", "context", "logit-bias", "n"])
def test_requests_the_model_cannot_take_are_refused_naming_the_field(
        request_: GenerateRequest, prompt: list[int], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_request(request_, prompt, LIMITS)
    assert err.value.param == param


def test_a_request_at_the_limits_is_taken() -> None:
    request = GenerateRequest("r", SamplingParams(max_tokens=59, n=4, temperature=1.0,
                                                  logit_bias=((999, 1.0),)),
                              prompt_token_ids=(999,) * 5)
    check_request(request, [999] * 5, LIMITS)


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("exc, structured, param", [
    (validation_error("top_p must be in (0, 1]", "top_p"), False, "top_p"),
    (validation_error("bad", "structured_outputs"), False, "response_format"),  # renamed
    (validation_error("too many", "logprobs"), False, "top_logprobs"),
    # vLLM 0.10 raised ValueError without a parameter: the field is guessed from the words
    (ValueError("The grammar could not be compiled"), True, "response_format"),
    (ValueError("The grammar could not be compiled"), False, None),
    (ValueError("logit_bias token 99999 is out of vocabulary"), False, "logit_bias"),
    (VLLMClientError(""), False, None),
])
def test_vllm_s_validation_errors_are_invalid_requests(exc: Exception, structured: bool,
                                                       param: str | None) -> None:
    mapped = map_vllm_error(exc, structured)
    assert isinstance(mapped, InvalidRequestError) and mapped.param == param
    assert mapped.message


def test_a_failed_request_is_an_engine_error_naming_its_cause() -> None:
    try:
        try:
            raise KeyError("kv load")
        except KeyError as cause:
            raise EngineGenerateError() from cause
    except EngineGenerateError as exc:
        mapped = map_vllm_error(exc)
    assert type(mapped) is EngineError and "kv load" in str(mapped)


def test_vllm_s_dead_engine_is_ours_and_other_errors_pass_through() -> None:
    mapped = map_vllm_error(VLLMEngineDeadError("EngineCore encountered an issue."))
    assert isinstance(mapped, EngineDeadError)
    bug = RuntimeError("a bug")
    assert map_vllm_error(bug) is bug
    ours = InvalidRequestError("x", "n")
    assert map_vllm_error(ours) is ours


# ---- engine arguments ------------------------------------------------------------------------


def test_engine_config_maps_onto_async_engine_args() -> None:
    config = EngineConfig(model="/models/m", dtype=DType.BFLOAT16, block_size=32,
                          max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096,
                          enable_prefix_caching=False, num_kv_blocks=900,
                          gpu_memory_utilization=0.5, kv_cache_bytes=2**30,
                          vllm=VLLMOptions(tensor_parallel_size=2, enforce_eager=True))
    assert engine_args_kwargs(config) == {
        "model": "/models/m", "served_model_name": "SmolLM2-135M-Instruct", "dtype": "bfloat16",
        "max_num_seqs": 128, "max_num_batched_tokens": 2048, "enable_prefix_caching": False,
        "block_size": 32, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2,
        "enforce_eager": True, "max_logprobs": 20, "disable_log_stats": False,
        "max_model_len": 4096, "num_gpu_blocks_override": 900, "kv_cache_memory_bytes": 2**30,
    }
    got = engine_args_kwargs(EngineConfig(model="/models/m"))
    assert not {"max_model_len", "num_gpu_blocks_override", "kv_cache_memory_bytes"} & set(got)
    assert got["gpu_memory_utilization"] == 0.9 and got["disable_log_stats"] is False


def test_lora_adapters_turn_on_vllm_s_lora_and_travel_as_lora_requests() -> None:
    config = EngineConfig(model="/models/m", lora_adapters={"tone": "/adapters/tone"},
                          max_loras=4, vllm=VLLMOptions(max_lora_rank=16))
    got = engine_args_kwargs(config)
    assert (got["enable_lora"], got["max_loras"], got["max_lora_rank"]) == (True, 4, 16)
    assert "enable_lora" not in engine_args_kwargs(EngineConfig(model="/models/m"))
    ids: dict[str, int] = {}
    assert lora_args(config, None, None, ids) is None
    assert lora_args(config, "tone", None, ids) == ("tone", 1, "/adapters/tone")
    assert lora_args(config, "added", "/shared/added", ids) == ("added", 2, "/shared/added")
    assert lora_args(config, "tone", None, ids) == ("tone", 1, "/adapters/tone")  # stable id
    for engine_config, name in ((config, "nope"), (EngineConfig(model="/m"), "tone")):
        with pytest.raises(InvalidRequestError) as err:
            lora_args(engine_config, name, None, {})
        assert err.value.param == "model"


@pytest.mark.parametrize("bad", [{"gpu_memory_utilization": 0.0},
                                 {"gpu_memory_utilization": 1.5}, {"kv_cache_bytes": 10},
                                 {"vllm": {"tensor_parallel_size": 0}},
                                 {"vllm": {"unknown": 1}}])
def test_vllm_options_are_bounded(bad: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        EngineConfig(**bad)  # type: ignore[arg-type]


# ---- load --------------------------------------------------------------------------------------


@dataclass
class SchedulerStatsRecord:  # vllm.v1.metrics.stats.SchedulerStats
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


def test_the_recorder_takes_both_versions_record_calls() -> None:
    recorder = SchedulerStatsRecorder()
    assert recorder.factory(object(), 0) is recorder
    recorder.record(None, None, 0)  # an iteration without scheduler stats
    assert recorder.latest is None and recorder.num_records == 0
    recorder.record(SchedulerStatsRecord(3, 1, 0.25), None, 0)  # vLLM 0.10: positional
    recorder.record(SchedulerStatsRecord(2, 0, 0.5), None, mm_cache_stats=None,
                    engine_idx=0)  # vLLM 0.34: keywords
    assert recorder.latest == SchedulerState(2, 0, 0.5) and recorder.num_records == 2
    # the rest of vLLM's logger interface is there, and does nothing
    assert recorder.log_engine_initialized() is None and recorder.log() is None


@pytest.mark.parametrize("state, in_flight, expected", [
    # vLLM's stats, capped by what is in flight; free = total x (1 - usage)
    (SchedulerState(5, 4, 0.25), InFlight(6, 5), (5, 1, 750, 10)),
    # nothing in flight: idle, whatever the last stats said
    (SchedulerState(5, 4, 0.9), InFlight(0, 0), (0, 0, 1000, 16)),
    # no stats yet: requests with a token run, the rest wait
    (None, InFlight(3, 1), (1, 2, 1000, 13)),
], ids=["stats", "idle", "no-stats"])
def test_load_estimate(state: SchedulerState | None, in_flight: InFlight,
                       expected: tuple[int, int, int, int]) -> None:
    load = estimate_load(state, in_flight, num_total_blocks=1000, max_num_seqs=16, num_steps=42)
    assert (load.num_running, load.num_waiting, load.num_free_kv_blocks,
            load.num_free_slots) == expected
    assert load.num_total_kv_blocks == 1000 and load.num_steps == 42


# ---- the engine without vLLM -------------------------------------------------------------------


def test_the_adapter_is_an_engine_and_refuses_work_before_start(tmp_path) -> None:
    engine = VLLMEngine(EngineConfig(model="/models/m"))
    assert isinstance(engine, Engine)
    with pytest.raises(EngineDeadError):
        engine.load()

    async def scenario() -> None:
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.abort("r")
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(GenerateRequest("r", prompt_token_ids=(1,))):
                pass
        await engine.shutdown()  # nothing started: nothing to do

    asyncio.run(scenario())
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path / "missing.bin"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_start_without_vllm_says_what_to_install() -> None:
    engine = VLLMEngine(EngineConfig(model="/models/m"))
    with pytest.raises(ModelLoadError) as err:
        asyncio.run(engine.start())
    assert "gpu" in str(err.value) and "vLLM" in str(err.value)

