"""``VLLMEngine``: vLLM's ``AsyncLLM`` (the v1 engine) behind fairserve's ``Engine`` contract.

NOTE: every choice of a request runs as a vLLM request of its own (``n=1``; id ``request_id``
when ``n == 1``, else ``request_id/index``), seeded ``seed + index`` as vLLM's own fan-out
seeds them. vLLM refuses ``n > 1`` with greedy sampling and a migrated request's choices stand
at different points, so its own fan-out cannot serve either; the prefix cache still shares the
prompt between the choices. Each choice is read by a pump task that turns vLLM's delta outputs
into chunks (``outputs.py``) and puts them on the request's one queue, which ``generate``
drains. ``abort`` cancels the pumps (vLLM's ``generate`` aborts its request in the engine core
when cancelled; vLLM 0.10 gives an aborted stream no final output) and ends every open choice
with its own ABORT chunk. vLLM frees the blocks in its engine core process shortly after, not
before ``abort`` returns; ``load()`` counts a request as gone once its pump has ended.

Prompts are rendered and validated here, with fairserve's own tokenizer of the same model
files (``prompt`` and ``messages`` mean exactly what they mean to the torch engine), and reach
vLLM as token ids. vLLM is imported only in ``start``. The engine belongs to the event loop
that starts it: vLLM's output handler task lives on that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from replicas.engine.config import EngineConfig
from replicas.engine.errors import EngineDeadError, EngineError, InvalidRequestError, ModelLoadError
from replicas.engine.interface import (
    CachedPrefix,
    Chunk,
    FinishReason,
    GenerateRequest,
    LoadSnapshot,
)
from replicas.engine.sampling_params import SamplingParams
from replicas.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from replicas.vllm_engine.admission import ModelLimits, check_request, given_prompt_count
from replicas.vllm_engine.engine_args import engine_args_kwargs, lora_args
from replicas.vllm_engine.error_map import map_vllm_error
from replicas.vllm_engine.load import InFlight, SchedulerStatsRecorder, estimate_load
from replicas.vllm_engine.outputs import ChoiceStream, ClockReading, chunks_from_output
from replicas.vllm_engine.resume import ChoicePlan, plan_choices
from replicas.vllm_engine.sampling import choice_kwargs

logger = logging.getLogger(__name__)

VLLM_MISSING = ("the vllm engine needs vLLM, which is not importable here: install fairserve's "
                "`gpu` extra (pip install 'fairserve[gpu]') on a machine with CUDA")
# what vLLM raises when it cannot build its config or start its engine core on this model
_START_ERRORS = (OSError, ValueError, RuntimeError, TypeError)


@dataclass(frozen=True, slots=True)
class _VLLMApi:
    """The vLLM names the adapter uses, imported in ``start``."""

    async_llm: Any  # vllm.v1.engine.async_llm.AsyncLLM
    engine_args: Any  # vllm.engine.arg_utils.AsyncEngineArgs
    sampling_params: Any  # vllm.SamplingParams
    delta: Any  # vllm.sampling_params.RequestOutputKind.DELTA
    structured_params: Any  # StructuredOutputsParams (newer) or GuidedDecodingParams (0.10)
    structured_keyword: str  # "structured_outputs" or "guided_decoding"
    lora_request: Any  # vllm.lora.request.LoRARequest


@dataclass(slots=True)
class _Choice:
    plan: ChoicePlan
    stream: ChoiceStream
    vllm_request_id: str
    params: Any  # vllm.SamplingParams; None for a choice with no token left to make
    task: asyncio.Task[None] | None = None

    @property
    def is_in_flight(self) -> bool:
        return self.task is not None and not self.task.done() and not self.stream.is_finished


@dataclass(slots=True)
class _Family:
    """One fairserve request: its choices and the queue its reader drains."""

    request: GenerateRequest
    choices: list[_Choice]
    sink: asyncio.Queue[Chunk | BaseException] = field(default_factory=asyncio.Queue)
    lora: Any = None  # its adapter's vllm.lora.request.LoRARequest, None: the base model


class VLLMEngine:
    """The ``Engine`` of ``engine.kind: vllm`` (its own knobs: ``config.vllm``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._api: _VLLMApi | None = None
        self._llm: Any = None  # vllm AsyncLLM
        self._tokenizer: Tokenizer | None = None
        self._limits: ModelLimits | None = None
        self._num_total_blocks = 0
        self._dtype = config.dtype.value  # vLLM's resolved dtype once started
        self._stats = SchedulerStatsRecorder()
        self._families: dict[str, _Family] = {}
        self._lora_ids: dict[str, int] = {}  # adapter name -> vLLM's lora_int_id
        self._last_progress_s = time.monotonic()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the tokenizer and start vLLM (its engine core process loads the model).

        vLLM is built on the event loop's thread, as its own server builds it; that blocks the
        loop while the model loads, which only delays the replica's start.
        """
        if self._llm is not None:
            return
        api = _import_vllm(self.config.model)
        self._tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
        try:
            args = api.engine_args(**engine_args_kwargs(self.config))
            llm = api.async_llm.from_engine_args(args, stat_loggers=[self._stats.factory])
        except _START_ERRORS as exc:
            raise ModelLoadError(f"vLLM could not start this model ({exc!r})",
                                 self.config.model) from exc
        model_config = llm.model_config
        self._limits = ModelLimits(vocab_size=int(model_config.get_vocab_size()),
                                   max_model_len=int(model_config.max_model_len),
                                   max_num_seqs=self.config.max_num_seqs)
        self._num_total_blocks = int(llm.vllm_config.cache_config.num_gpu_blocks or 0)
        self._dtype = str(model_config.dtype).removeprefix("torch.")
        self._api, self._llm = api, llm
        logger.info("vLLM engine ready: %s, %d KV blocks", self.config.model,
                    self._num_total_blocks)

    async def shutdown(self) -> None:
        """End every open choice with ABORT, then stop vLLM's engine core."""
        if self._llm is None:
            return
        for family in list(self._families.values()):
            await self._abort_family(family)
        llm, self._llm = self._llm, None
        llm.shutdown()

    # ---- the Engine API --------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        """Yield the chunks of every open choice; see ``Engine.generate``."""
        family = self._admit(request)  # raises InvalidRequestError before anything runs
        try:
            self._start_choices(family)
            num_open = len(family.choices)
            while num_open:
                item = await family.sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.is_final:
                    num_open -= 1
        finally:  # ended, failed, or the reader went away: stop what still runs
            await asyncio.shield(self._close(family))

    async def abort(self, request_id: str) -> bool:
        self._running_llm()
        family = self._families.get(request_id)
        return False if family is None else await self._abort_family(family)

    def cached_prefix(self) -> CachedPrefix:
        """Not told: vLLM's block hashes are its own (prefix_affinity then relies on what each
        router sent where)."""
        return CachedPrefix()

    def load(self) -> LoadSnapshot:
        if self._llm is None:
            raise EngineDeadError("the engine has not been started")
        load = estimate_load(self._stats.latest, self._in_flight(), self._num_total_blocks,
                             self.config.max_num_seqs, self._stats.num_records)
        return dataclasses.replace(load, compute=f"vllm cuda {self._dtype}")

    async def check_health(self) -> None:
        llm = self._running_llm()
        try:
            await llm.check_health()
        except Exception as exc:  # noqa: BLE001 - whatever vLLM raises, it is not healthy
            raise EngineDeadError(f"vLLM's health check failed: {exc!r}") from exc
        in_flight = self._in_flight()
        last_s = max(self._last_progress_s, self._stats.last_record_s)
        stalled_s = time.monotonic() - last_s
        if in_flight.num_requests and stalled_s > self.config.max_queue_wait_s:
            raise EngineDeadError(f"vLLM has returned nothing for {stalled_s:.1f} s with "
                                  f"{in_flight.num_requests} requests in flight")

    # ---- admission ---------------------------------------------------------------------------

    def _admit(self, request: GenerateRequest) -> _Family:
        """Validate, plan the choices and build their vLLM parameters; register the request."""
        self._running_llm()
        assert self._limits is not None and self._api is not None
        if request.request_id in self._families:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running",
                                      "request_id")
        prompt_ids = self._prompt_token_ids(request)
        check_request(request, prompt_ids, self._limits)
        sampling = request.sampling
        text_of = partial(self._resumed_text, tuple(prompt_ids), sampling.skip_special_tokens)
        plans = plan_choices(request, prompt_ids, self._limits.vocab_size, text_of)
        arrived_s = request.arrival_time_s if request.arrival_time_s is not None else time.time()
        choices = []
        for plan in plans:
            stream = ChoiceStream(
                request_id=request.request_id,
                index=plan.index,
                num_prompt_tokens=len(prompt_ids),
                num_engine_prompt_tokens=len(plan.prompt_token_ids),
                arrived_s=arrived_s,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                num_top_logprobs=sampling.top_logprobs if sampling.logprobs else None,
                num_resumed_tokens=plan.num_resumed_tokens,
                pending_text=plan.pending_text,
            )
            vllm_id = (request.request_id if sampling.n == 1
                       else f"{request.request_id}/{plan.index}")
            params = None if plan.is_exhausted else self._vllm_params(sampling, plan)
            choices.append(_Choice(plan, stream, vllm_id, params))
        lora = lora_args(self.config, request.adapter, request.adapter_path, self._lora_ids)
        family = _Family(request, choices,
                         lora=None if lora is None else self._api.lora_request(*lora))
        self._families[request.request_id] = family
        return family

    def _prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        assert self._tokenizer is not None
        if given_prompt_count(request) != 1:
            raise InvalidRequestError(
                "give exactly one of prompt_token_ids, prompt or messages", "prompt")
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return self._tokenizer.encode(request.prompt)
        assert request.messages is not None
        return self._tokenizer.apply_chat_template(list(request.messages))

    def _resumed_text(self, prompt_ids: tuple[int, ...], skip_special_tokens: bool,
                      token_ids: tuple[int, ...]) -> str:
        """Text of a migrated choice's tokens after the prompt, as the torch engine makes it
        (an unfinished multi-byte character held back: vLLM completes it in context)."""
        assert self._tokenizer is not None
        detokenizer = IncrementalDetokenizer(self._tokenizer, prompt_ids, skip_special_tokens)
        detokenizer.add(token_ids)
        return detokenizer.text

    def _vllm_params(self, sampling: SamplingParams, plan: ChoicePlan) -> Any:
        assert self._api is not None
        api = self._api
        translated = choice_kwargs(sampling, plan.index, plan.num_resumed_tokens)
        kwargs = dict(translated.kwargs, output_kind=api.delta)
        try:
            if translated.constraint is not None:
                kwargs[api.structured_keyword] = api.structured_params(**translated.constraint)
            return api.sampling_params(**kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM's validation errors, mapped by name
            mapped = map_vllm_error(exc, sampling.structured_output is not None)
            if mapped is exc:
                raise
            raise mapped from exc

    # ---- the pumps -----------------------------------------------------------------------------

    def _start_choices(self, family: _Family) -> None:
        if self._in_flight().num_requests == 0:
            self._last_progress_s = time.monotonic()  # an idle engine has not stalled
        for choice in family.choices:
            if choice.params is None:  # a migrated choice that has every token: it ends here
                family.sink.put_nowait(choice.stream.end_chunk(FinishReason.LENGTH,
                                                               ClockReading.now()))
                continue
            choice.task = asyncio.create_task(self._pump(family, choice),
                                              name=f"vllm-{choice.vllm_request_id}")

    async def _pump(self, family: _Family, choice: _Choice) -> None:
        """Relay one vLLM request's outputs as chunks; hand any failure to the reader."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(choice.plan.prompt_token_ids)}
        if family.request.cache_salt:  # vLLM partitions its prefix cache the same way
            prompt["cache_salt"] = family.request.cache_salt  # a TokensPrompt
        streams = {0: choice.stream}
        try:
            llm = self._running_llm()
            async for output in llm.generate(prompt, choice.params, choice.vllm_request_id,
                                             lora_request=family.lora):
                self._last_progress_s = time.monotonic()
                for chunk in chunks_from_output(output, streams, ClockReading.now()):
                    family.sink.put_nowait(chunk)
            if not choice.stream.is_finished:
                raise EngineError(f"vLLM ended {choice.vllm_request_id} without a final output")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the pump's boundary: the reader raises it
            mapped = map_vllm_error(exc, family.request.sampling.structured_output is not None)
            if mapped is not exc:
                mapped.__cause__ = exc
            family.sink.put_nowait(mapped)

    async def _abort_family(self, family: _Family) -> bool:
        """End every open choice with ABORT; True if one was open."""
        open_choices = [c for c in family.choices if not c.stream.is_finished]
        await self._stop_pumps(family)
        now = ClockReading.now()
        for choice in open_choices:
            if not choice.stream.is_finished:  # it may have ended while the pumps stopped
                family.sink.put_nowait(choice.stream.end_chunk(FinishReason.ABORT, now))
        return bool(open_choices)

    async def _stop_pumps(self, family: _Family) -> None:
        """Cancel the pumps still running and abort their vLLM requests.

        vLLM's ``generate`` aborts its request when cancelled, except while the request is
        still being added (it has no handle on it yet); the explicit abort after it covers that
        and is a no-op for a request vLLM no longer knows.
        """
        stopped = [c for c in family.choices if c.task is not None and not c.task.done()]
        if not stopped:
            return
        tasks = [c.task for c in stopped if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        llm = self._llm
        if llm is None or llm.errored:
            return
        for choice in stopped:
            try:
                await llm.abort(choice.vllm_request_id)  # vLLM 0.10 takes one id at a time
            except Exception as exc:  # noqa: BLE001 - a failed abort must not stop the others
                logger.warning("vLLM could not abort %s: %r", choice.vllm_request_id, exc)

    async def _close(self, family: _Family) -> None:
        await self._stop_pumps(family)
        if self._families.get(family.request.request_id) is family:
            del self._families[family.request.request_id]

    # ---- state -------------------------------------------------------------------------------

    def _running_llm(self) -> Any:
        llm = self._llm
        if llm is None:
            raise EngineDeadError("the engine is not running")
        if llm.errored:
            raise EngineDeadError("the vLLM engine died")
        return llm

    def _in_flight(self) -> InFlight:
        choices = [c for f in self._families.values() for c in f.choices if c.is_in_flight]
        return InFlight(num_requests=len(choices),
                        num_started=sum(c.stream.first_token_s is not None for c in choices))


def load_tokenizer(path: str) -> Tokenizer:
    """fairserve's tokenizer of the model vLLM loads: a Hugging Face directory's, or the one
    a GGUF file embeds. Raises ``ModelLoadError``."""
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        return Tokenizer.from_gguf(path)
    raise ModelLoadError("not a .gguf file nor a Hugging Face model directory", path)


def _import_vllm(model_path: str) -> _VLLMApi:
    """vLLM's names, or ``ModelLoadError`` saying what to install."""
    try:
        import vllm.sampling_params as vllm_sampling
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.async_llm import AsyncLLM
    except (ImportError, OSError) as exc:  # OSError: vLLM present, its CUDA libraries not
        raise ModelLoadError(f"{VLLM_MISSING} ({exc})", model_path) from exc
    structured = getattr(vllm_sampling, "StructuredOutputsParams", None)
    keyword = "structured_outputs"
    if structured is None:  # vLLM 0.10
        structured, keyword = vllm_sampling.GuidedDecodingParams, "guided_decoding"
    return _VLLMApi(
        async_llm=AsyncLLM,
        engine_args=AsyncEngineArgs,
        sampling_params=vllm_sampling.SamplingParams,
        delta=vllm_sampling.RequestOutputKind.DELTA,
        structured_params=structured,
        structured_keyword=keyword,
        lora_request=LoRARequest,
    )
