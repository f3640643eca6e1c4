"""The Engine contract, run against every engine (the torch engine here; vLLM on GPU machines).

Real model, real engine thread: streaming chunks, final usage and timings, validation before
scheduling, abort and disconnect freeing KV blocks at once, seeds, stop strings, logprobs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time

import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.errors import InvalidRequestError
from replicas.engine.interface import (
    ChoiceResume,
    Engine,
    FinishReason,
    GenerateRequest,
    SchedulingHints,
)
from replicas.engine.sampling_params import GuideKind, SamplingParams, StructuredOutput
from replicas.torch_engine.async_engine import TorchEngine

pytestmark = pytest.mark.slow

CAPITAL = ({"role": "user", "content": "Which city is the capital of France?"},)
STORY = ({"role": "user", "content": "Tell me a short story about a lighthouse keeper."},)


@pytest.fixture(scope="module")
def engine():
    loop = asyncio.new_event_loop()
    eng = TorchEngine(EngineConfig(max_num_batched_tokens=128, max_num_seqs=16, max_model_len=2048))
    loop.run_until_complete(eng.start())
    yield loop, eng
    loop.run_until_complete(eng.shutdown())
    loop.close()


def run(engine, coro):
    loop, _ = engine
    return loop.run_until_complete(coro)


async def collect(eng: Engine, request: GenerateRequest):
    return [chunk async for chunk in eng.generate(request)]


def _all_blocks_free(eng: TorchEngine) -> bool:
    load = eng.load()
    return load.num_free_kv_blocks == load.num_total_kv_blocks and load.num_running == 0


def test_is_an_engine(engine) -> None:
    assert isinstance(engine[1], Engine)


def test_stream_final_chunk_has_usage_and_ordered_timings(engine) -> None:
    _, eng = engine
    req = GenerateRequest("t1", SamplingParams(max_tokens=20, temperature=0.0), messages=CAPITAL)
    chunks = run(engine, collect(eng, req))
    assert all(not c.is_final for c in chunks[:-1]) and chunks[-1].is_final
    assert "".join(c.text for c in chunks) == "The capital of France is Paris."
    final = chunks[-1]
    assert final.finish_reason is FinishReason.STOP
    assert final.usage.num_output_tokens == sum(len(c.token_ids) for c in chunks)
    assert final.usage.num_prompt_tokens > 10
    t = final.timings
    assert t.arrived_s <= t.first_scheduled_s <= t.first_token_s <= t.finished_s
    assert t.num_prefill_chunks >= 1
    assert _all_blocks_free(eng)


def test_max_tokens_finishes_with_length(engine) -> None:
    _, eng = engine
    req = GenerateRequest("t2", SamplingParams(max_tokens=7, temperature=0.0), messages=STORY)
    chunks = run(engine, collect(eng, req))
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert chunks[-1].usage.num_output_tokens == 7


def test_stop_string_truncates_text(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=("Paris",))
    chunks = run(engine, collect(eng, GenerateRequest("t3", params, messages=CAPITAL)))
    assert "".join(c.text for c in chunks) == "The capital of France is "
    assert chunks[-1].finish_reason is FinishReason.STOP


def test_stop_token_id(engine) -> None:
    _, eng = engine
    tok = eng.core.tokenizer
    greedy = run(engine, collect(eng, GenerateRequest("t4a", SamplingParams(max_tokens=20, temperature=0.0), messages=CAPITAL)))
    ids = [t for c in greedy for t in c.token_ids]
    stop_id = ids[3]
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_id,))
    chunks = run(engine, collect(eng, GenerateRequest("t4b", params, messages=CAPITAL)))
    got = [t for c in chunks for t in c.token_ids]
    assert got == ids[:4] and chunks[-1].finish_reason is FinishReason.STOP
    assert "".join(c.text for c in chunks) == tok.decode(ids[:3])


def test_invalid_requests_are_rejected_before_scheduling(engine) -> None:
    _, eng = engine
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=-0.5)
    assert err.value.param == "temperature"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(top_p=0.0)
    assert err.value.param == "top_p"
    too_long = GenerateRequest("t5", SamplingParams(max_tokens=4000), messages=CAPITAL)
    with pytest.raises(InvalidRequestError) as err:
        run(engine, collect(eng, too_long))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        run(engine, collect(eng, GenerateRequest("t6", prompt="")))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        run(engine, collect(eng, GenerateRequest("t7", prompt_token_ids=(10**7,))))
    assert eng.load().num_waiting == 0 and _all_blocks_free(eng)


def test_same_seed_same_text_whatever_the_batch(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    async def alone():
        return await collect(eng, GenerateRequest("s-alone", params, messages=STORY))

    async def crowded():
        others = [
            collect(eng, GenerateRequest(f"s-other{i}", SamplingParams(max_tokens=30, temperature=1.0), messages=CAPITAL))
            for i in range(5)
        ]
        results = await asyncio.gather(collect(eng, GenerateRequest("s-crowd", params, messages=STORY)), *others)
        return results[0]

    a = "".join(c.text for c in run(engine, alone()))
    b = "".join(c.text for c in run(engine, crowded()))
    assert a == b and len(a) > 20
    other = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    c = "".join(x.text for x in run(engine, collect(eng, GenerateRequest("s-other-seed", other, messages=STORY))))
    assert c != a


def test_logprobs(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3)
    chunks = run(engine, collect(eng, GenerateRequest("lp", params, messages=CAPITAL)))
    for c in chunks:
        for lp in c.logprobs:
            assert lp.logprob <= 0.0 and len(lp.top) == 3
            # greedy: the sampled token is the most likely one
            assert lp.top[0][0] == lp.token_id and math.isclose(lp.top[0][1], lp.logprob)


def test_abort_mid_stream_frees_blocks_at_once(engine) -> None:
    _, eng = engine

    async def scenario():
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = eng.generate(GenerateRequest("ab", params, messages=STORY))
        got = [await stream.__anext__(), await stream.__anext__()]
        assert eng.load().num_running == 1
        assert await eng.abort("ab") is True
        assert _all_blocks_free(eng)  # abort returns once the blocks are freed
        rest = [c async for c in stream]
        assert await eng.abort("ab") is False
        return got + rest

    chunks = run(engine, scenario())
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert chunks[-1].usage.num_output_tokens < 200


def test_reader_that_goes_away_frees_blocks(engine) -> None:
    _, eng = engine

    async def scenario():
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        readers = []
        for i in range(4):
            stream = eng.generate(GenerateRequest(f"gone{i}", params, messages=STORY))
            readers.append(stream)
            await stream.__anext__()
        for stream in readers:
            await stream.aclose()  # what a client disconnect does to the generator
        return eng.load()

    load = run(engine, scenario())
    assert load.num_running == 0 and load.num_waiting == 0
    assert load.num_free_kv_blocks == load.num_total_kv_blocks


def test_concurrent_requests_and_health(engine) -> None:
    _, eng = engine

    async def scenario():
        reqs = [
            collect(eng, GenerateRequest(f"c{i}", SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True), messages=STORY))
            for i in range(12)
        ]
        results = await asyncio.gather(*reqs)
        await eng.check_health()
        return results

    results = run(engine, scenario())
    for i, chunks in enumerate(results):
        assert chunks[-1].usage.num_output_tokens == 8 + i
    assert _all_blocks_free(eng)


def test_scheduling_hints_reach_the_scheduler_and_leave_the_text_alone(engine) -> None:
    """Tenants' hints (the router's key, priority class, weight) reach the torch engine's fair
    scheduler, whose counters then hold each key's computed tokens over its weight; the greedy
    text is the one without hints."""
    _, eng = engine
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def scenario():
        plain = await collect(eng, GenerateRequest("h-plain", sampling, messages=CAPITAL))
        hinted = []
        for key, priority, weight in (("tenant-a", 0, 1.0), ("tenant-b", 1, 4.0)):  # one by one
            hints = SchedulingHints(key, priority, weight)
            hinted.append(await collect(eng, GenerateRequest(f"h-{key}", sampling,
                                                             messages=CAPITAL, scheduling=hints)))
        return plain, hinted

    plain, hinted = run(engine, scenario())
    text = "".join(c.text for c in plain)
    assert ["".join(c.text for c in chunks) for chunks in hinted] == [text, text]
    if isinstance(eng, TorchEngine):
        counters = eng.core.scheduler.counters
        for key, weight, chunks in (("tenant-a", 1.0, hinted[0]), ("tenant-b", 4.0, hinted[1])):
            usage = chunks[-1].usage
            computed = usage.num_prompt_tokens - usage.num_cached_tokens + 5  # + 5 decodes
            assert counters[key] == computed / weight
    with pytest.raises(ValueError, match="weight must be positive"):
        SchedulingHints("t", weight=0)


def test_cached_prefix_names_the_prompt_blocks_the_engine_cached(engine) -> None:
    """What a replica publishes for prefix-aware routing: the routers hash a prompt's blocks
    the same way (router/dispatch/prefix_affinity.py) and find them in the engine's set."""
    from router.dispatch.prefix_affinity import block_hashes

    _, eng = engine
    prompt = tuple(range(1000, 1000 + 70))  # 4 full blocks of 16 and a partial one
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    before = eng.cached_prefix()
    run(engine, collect(eng, GenerateRequest("published", sampling, prompt_token_ids=prompt)))
    hashes = block_hashes(prompt, eng.config.block_size)
    deadline = time.monotonic() + 5
    while not set(hashes) <= set(eng.cached_prefix().block_hashes):
        if not isinstance(eng, TorchEngine):
            assert eng.cached_prefix().block_hashes == ()  # vLLM does not tell
            return
        assert time.monotonic() < deadline, "the engine did not publish the prompt's blocks"
        time.sleep(0.1)
    assert eng.cached_prefix().version != before.version


def test_progress_counts_every_step_and_in_torch_every_layer_within_a_step(engine) -> None:
    """What the dispatchers watch to tell a slow replica from a hung one (the load report's
    ``progress``): it never counts fewer than the steps; the torch engine's moves while a step
    runs (its model layers), so a step longer than the stall timeout is not a stall."""
    _, eng = engine
    prompt = tuple(range(2000, 2000 + 600))  # 5 prefill steps of 128 tokens, then decodes
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def scenario():
        seen = []
        task = asyncio.ensure_future(collect(eng, GenerateRequest("progress", sampling,
                                                                  prompt_token_ids=prompt)))
        while not task.done():
            load = eng.load()
            seen.append((load.num_steps, load.progress))
            await asyncio.sleep(0.001)
        await task
        return seen

    before = eng.load()
    seen = run(engine, scenario())
    after = eng.load()
    assert after.num_steps >= before.num_steps + 4  # at least one per output token
    assert after.progress - before.progress >= after.num_steps - before.num_steps
    if isinstance(eng, TorchEngine):
        num_layers = eng.core.model_config.num_layers
        assert after.num_steps - before.num_steps == 8  # 5 prefill steps (the last samples), 3
        assert after.progress - before.progress == (after.num_steps - before.num_steps) * (
            1 + num_layers)
        within_a_step = [(a, b) for a, b in itertools.pairwise(seen)
                         if a[0] == b[0] and b[1] > a[1]]
        assert within_a_step, "the progress never moved during a step"


# ---- the extensions clients send: n, structured output, penalties, bias, stop strings ----

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}
JSON_ASK = ({"role": "user", "content": "Describe a person as JSON with name, age and city."},)


def _choices(chunks) -> dict[int, list]:
    by_index: dict[int, list] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    return by_index


def test_n_choices_share_the_prompt_through_the_prefix_cache(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=12, temperature=0.0, n=3)
    chunks = run(engine, collect(eng, GenerateRequest("n3", params, messages=STORY)))
    choices = _choices(chunks)
    assert sorted(choices) == [0, 1, 2]
    texts = {"".join(c.text for c in cs) for cs in choices.values()}
    assert len(texts) == 1  # greedy choices are equal
    finals = [cs[-1] for cs in choices.values()]
    assert all(f.is_final and f.usage.num_output_tokens == 12 for f in finals)
    prompt = finals[0].usage.num_prompt_tokens
    # the later choices found every full block of the prompt cached by the first one
    assert all(f.usage.num_cached_tokens == (prompt - 1) // 16 * 16 > 0 for f in finals[1:])
    assert _all_blocks_free(eng)


def test_seeded_choices_are_reproducible_and_choice_0_is_the_single_request(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3)
    texts = []
    for attempt in range(2):
        chunks = run(engine, collect(eng, GenerateRequest(f"sn{attempt}", params, messages=STORY)))
        texts.append({i: "".join(c.text for c in cs) for i, cs in _choices(chunks).items()})
    assert texts[0] == texts[1] and len(set(texts[0].values())) == 3
    single = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    alone = run(engine, collect(eng, GenerateRequest("s1", single, messages=STORY)))
    assert "".join(c.text for c in alone) == texts[0][0]


def test_abort_ends_every_choice(engine) -> None:
    _, eng = engine

    async def scenario():
        params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, n=3)
        stream = eng.generate(GenerateRequest("nab", params, messages=STORY))
        await stream.__anext__()
        assert await eng.abort("nab") is True
        return [c async for c in stream]

    rest = run(engine, scenario())
    aborted = [c for c in rest if c.finish_reason is FinishReason.ABORT]
    assert sorted(c.index for c in aborted) == [0, 1, 2]
    assert _all_blocks_free(eng)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(engine, temperature: float) -> None:
    import jsonschema

    _, eng = engine
    spec = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(PERSON))
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=3, n=2,
                            structured_output=spec)
    chunks = run(engine, collect(eng, GenerateRequest(f"js{temperature}", params,
                                                      messages=JSON_ASK)))
    for choice in _choices(chunks).values():
        assert choice[-1].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads("".join(c.text for c in choice)), PERSON)


def test_json_object_output_is_an_object(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=80, temperature=0.0,
                            structured_output=StructuredOutput(GuideKind.JSON_OBJECT))
    chunks = run(engine, collect(eng, GenerateRequest("jo", params, messages=JSON_ASK)))
    assert isinstance(json.loads("".join(c.text for c in chunks)), dict)


def test_a_schema_that_does_not_compile_is_refused_naming_response_format(engine) -> None:
    _, eng = engine
    bad = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps({"type": "string",
                                                              "pattern": "("}))
    for spec in (bad, StructuredOutput(GuideKind.JSON_SCHEMA, '{"$ref": "#/nowhere"}')):
        params = SamplingParams(max_tokens=8, structured_output=spec)
        with pytest.raises(InvalidRequestError) as err:
            run(engine, collect(eng, GenerateRequest("bad", params, messages=JSON_ASK)))
        assert err.value.param == "response_format"
    assert _all_blocks_free(eng)


def test_logit_bias_minus_100_bans_a_token(engine) -> None:
    _, eng = engine
    tok = eng.core.tokenizer
    paris = tok.encode(" Paris")[-1]
    plain = run(engine, collect(eng, GenerateRequest(
        "lb0", SamplingParams(max_tokens=12, temperature=0.0), messages=CAPITAL)))
    assert paris in [t for c in plain for t in c.token_ids]
    params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((paris, -100.0),))
    banned = run(engine, collect(eng, GenerateRequest("lb1", params, messages=CAPITAL)))
    assert paris not in [t for c in banned for t in c.token_ids]
    with pytest.raises(InvalidRequestError) as err:
        too_big = SamplingParams(logit_bias=((10**6, 1.0),))
        run(engine, collect(eng, GenerateRequest("lb2", too_big, messages=CAPITAL)))
    assert err.value.param == "logit_bias"


def test_include_stop_str_in_output_keeps_the_stop_string(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=("Paris",),
                            include_stop_str_in_output=True)
    chunks = run(engine, collect(eng, GenerateRequest("isi", params, messages=CAPITAL)))
    assert "".join(c.text for c in chunks) == "The capital of France is Paris"


# ---- resume (a migrated request continues where its client is) ----


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 0.9, "seed": 1234, "top_p": 0.95},
    {"temperature": 1.0, "seed": 5, "frequency_penalty": 0.8, "repetition_penalty": 1.2},
], ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("cut", [1, 9])
def test_a_resumed_request_continues_as_the_uninterrupted_one(engine, sampling, cut) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    whole = run(engine, collect(eng, GenerateRequest(f"w{cut}", params, messages=STORY)))
    tokens = [t for c in whole for t in c.token_ids]
    text = "".join(c.text for c in whole)
    sent = "".join(c.text for c in whole[:cut])  # what the client had when the replica died
    resume = ChoiceResume(0, tuple(tokens[:cut]), len(sent))
    rest = run(engine, collect(eng, GenerateRequest(f"r{cut}", params, messages=STORY,
                                                    resume=(resume,))))
    assert tokens[cut:] == [t for c in rest for t in c.token_ids]
    assert sent + "".join(c.text for c in rest) == text  # no gap, no duplicate
    assert rest[-1].usage.num_output_tokens == whole[-1].usage.num_output_tokens == 24


def test_a_resumed_choice_keeps_its_grammar_and_finished_choices_stay_done(engine) -> None:
    import jsonschema

    _, eng = engine
    spec = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(PERSON))
    params = SamplingParams(max_tokens=80, temperature=0.0, n=2, structured_output=spec)
    whole = run(engine, collect(eng, GenerateRequest("jw", params, messages=JSON_ASK)))
    first = [c for c in whole if c.index == 0]
    tokens = [t for c in first for t in c.token_ids]
    sent = "".join(c.text for c in first[:6])
    resume = (ChoiceResume(0, tuple(tokens[:6]), len(sent)),
              ChoiceResume(1, is_finished=True))
    rest = run(engine, collect(eng, GenerateRequest("jr", params, messages=JSON_ASK,
                                                    resume=resume)))
    assert {c.index for c in rest} == {0}  # the finished choice does not run again
    jsonschema.validate(json.loads(sent + "".join(c.text for c in rest)), PERSON)
