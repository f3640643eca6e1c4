"""The synchronous engine: admission checks, and one step = schedule, run, sample, emit.

``EngineCore`` is driven by one thread (the async engine's loop); nothing in it is thread-safe.
It owns the scheduler, the block manager, the model runner and the sampler, and turns each
step's samples into ``Chunk`` objects.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from replicas.engine.config import EngineConfig, Quantization
from replicas.engine.errors import InvalidRequestError
from replicas.engine.interface import Chunk, FinishReason, GenerateRequest, LoadSnapshot
from replicas.engine.resume_rules import check_resume
from replicas.engine.sampling_params import SamplingParams
from replicas.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from replicas.protocol import adapter_salt, cache_root
from replicas.torch_engine import device_choice, kv_budget
from replicas.torch_engine.block_manager import BlockManager
from replicas.torch_engine.guide import Guide, GuideFactory
from replicas.torch_engine.loader import ModelSource, load_model_source
from replicas.torch_engine.lora import AdapterCache, AdapterError, LoraAdapter
from replicas.torch_engine.model_runner import CacheShape, ModelRunner
from replicas.torch_engine.models.cpu_linear import can_pack
from replicas.torch_engine.models.llama import LlamaForCausalLM
from replicas.torch_engine.output_processor import RequestOutput
from replicas.torch_engine.sampler import Sampler
from replicas.torch_engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from replicas.torch_engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed validation: what the engine thread needs to start it."""

    request: GenerateRequest
    prompt_token_ids: list[int]
    arrival_s: float
    guides: tuple[Guide, ...] = ()  # one per choice, with a response format


@dataclass(slots=True)
class _Family:
    """The sequences of one request: one, or one per choice when n > 1.

    NOTE: choices share the prompt's KV blocks through the prefix cache, which registers a
    block only once its KV is computed. So the first choice runs alone until its prefill is
    done (its first token); then the others are scheduled and find every full block of the
    prompt cached, computing only the partial last block.
    """

    seq_ids: list[str]
    parked: list[Sequence]  # choices waiting for the first one's prefill


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        self.config = config
        source = source or load_model_source(config.model, cache_dir=config.model_cache_dir)
        self.model_config = source.config
        self.tokenizer: Tokenizer = source.tokenizer
        self.compute = device_choice.choose(config)
        self.device = self.compute.device
        self.dtype = device_choice.TORCH_DTYPES[self.compute.dtype.value]
        model_max = source.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        model = LlamaForCausalLM(source.config, max_positions=self.max_model_len)
        model.load_weights(source.weights())
        self.compute = device_choice.with_quantization(self.compute, config)
        if self.compute.quantization is Quantization.INT4:
            model.quantize_int4()  # from the float32 weights, before the cast
        model.to(device=self.device, dtype=self.dtype).eval()
        if can_pack(self.device, self.dtype):
            model.pack_for_cpu()
            if self.compute.uses_cpu_kernels:
                model.use_cpu_kernels()
        self.cache_shape = self._cache_shape()  # after the weights: a GPU's budget is what is left
        self.runner = ModelRunner(model, self.cache_shape, self.device, self.dtype)
        self.adapters = AdapterCache({n: Path(p) for n, p in config.lora_adapters.items()},
                                     source.config, config.max_loras)
        self.block_manager = BlockManager(
            self.cache_shape.num_blocks, config.block_size, config.enable_prefix_caching,
            keys_token_kinds=self.compute.quantization is Quantization.INT4,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            config.scheduling_policy, config.max_prompt_tokens_with_decodes),
            self.block_manager,
        )
        eos = tuple(self.tokenizer.eos_token_ids)
        self.sampler = Sampler(eos, self.device)
        self.guides = GuideFactory(self.tokenizer, source.config.vocab_size)
        self._eos = frozenset(eos)
        self._outputs: dict[str, RequestOutput] = {}  # by sequence id
        self._families: dict[str, _Family] = {}  # by request id
        self._num_steps = 0
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
            config.model, self.compute.describe(), self.cache_shape.num_blocks,
            config.block_size, self.max_model_len,
        )

    def _cache_shape(self) -> CacheShape:
        cfg = self.model_config
        per_block = CacheShape.bytes_per_block(cfg, self.config.block_size, self.dtype)
        if self.config.num_kv_blocks is not None:  # exact: no budget to measure
            return CacheShape(self.config.num_kv_blocks, self.config.block_size, cfg.num_layers,
                              cfg.num_kv_heads, cfg.head_dim)
        budget = kv_budget.kv_cache_bytes(self.config, self.device, cfg, self.dtype)
        num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(
                f"the KV budget ({budget} bytes) buys {num_blocks} KV blocks of "
                f"{per_block} bytes; at least 2 are needed"
            )
        if self.config.kv_cache_bytes is None and self.device.type == "cuda" \
                and num_blocks * self.config.block_size < self.max_model_len:
            # the router assumes a GPU replica holds one whole context (replicas/model_info.py)
            raise ValueError(
                f"the GPU's KV budget holds {num_blocks * self.config.block_size} tokens, fewer "
                f"than max_model_len ({self.max_model_len}); lower max_model_len or raise "
                "gpu_memory_utilization")
        return CacheShape(num_blocks, self.config.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    # ---- admission -------------------------------------------------------------------------

    def prepare(self, request: GenerateRequest) -> PreparedRequest:
        """Validate and tokenize; raises ``InvalidRequestError`` naming the field."""
        prompt_ids = self._prompt_token_ids(request)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", _prompt_param(request))
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        needed = len(prompt_ids) + request.sampling.max_tokens
        if needed > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(prompt_ids)} and max_tokens is {request.sampling.max_tokens}",
                "max_tokens",
            )
        capacity = self.cache_shape.num_blocks * self.cache_shape.block_size
        if needed > capacity:
            raise InvalidRequestError(
                f"the request needs {needed} tokens of KV cache; this engine holds {capacity}",
                "max_tokens",
            )
        self._check_sampling(request.sampling)
        check_resume(request, self.model_config.vocab_size)
        spec = request.sampling.structured_output
        guides = () if spec is None else tuple(
            self.guides.guide(spec) for _ in range(request.sampling.n))
        arrival = request.arrival_time_s if request.arrival_time_s is not None else time.time()
        return PreparedRequest(request, prompt_ids, arrival, guides)

    def _check_sampling(self, sampling: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        outside = [t for t, _ in sampling.logit_bias if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"logit_bias: token id {outside[0]} is not in the vocabulary [0, {vocab})",
                "logit_bias")
        if sampling.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n ({sampling.n}) exceeds the sequences this engine runs at once "
                f"({self.config.max_num_seqs})", "n")

    def _prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        given = [x is not None for x in (request.prompt_token_ids, request.prompt, request.messages)]
        if sum(given) != 1:
            raise InvalidRequestError(
                "give exactly one of prompt_token_ids, prompt or messages", "prompt"
            )
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt)
        assert request.messages is not None
        return self.tokenizer.apply_chat_template(list(request.messages))

    def add(self, prepared: PreparedRequest) -> None:
        request = prepared.request
        if request.request_id in self._families:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", "request_id")
        sampling = request.sampling
        resumes = {r.index: r for r in request.resume}
        lora = self._adapter(request.adapter, request.adapter_path)
        # an adapter's KV differs from the base model's: its own prefix-cache partition
        root = cache_root(adapter_salt(request.cache_salt, None if lora is None else lora.name))
        seqs = []
        for index in range(sampling.n):
            resume = resumes.get(index)
            if resume is not None and resume.is_finished:
                continue
            seq_id = request.request_id if sampling.n == 1 else f"{request.request_id}/{index}"
            seq = Sequence.from_prompt(seq_id, prepared.prompt_token_ids, _choice(sampling, index),
                                       arrival_s=prepared.arrival_s, cache_root=root, lora=lora)
            seq.guide = prepared.guides[index] if prepared.guides else None
            if request.scheduling is not None:
                hints = request.scheduling
                seq.fair_key, seq.priority, seq.weight = hints.key, hints.priority, hints.weight
            detok = IncrementalDetokenizer(
                self.tokenizer, prepared.prompt_token_ids, sampling.skip_special_tokens
            )
            out = RequestOutput(seq, detok, self._eos, request.request_id, index)
            if resume is not None:
                out.resume(resume.token_ids, resume.num_text_chars_sent)
            self._outputs[seq_id] = out
            seqs.append(seq)
        self._families[request.request_id] = _Family([s.request_id for s in seqs], seqs[1:])
        self.scheduler.add(seqs[0])

    def _adapter(self, name: str | None, path: str | None) -> LoraAdapter | None:
        if name is None:
            return None
        try:
            if path is not None and self.adapters.paths.get(name) != Path(path):
                self.adapters.register(name, Path(path))  # added at run time
            adapter = self.adapters.get(name)
            self.runner.uses_lora = True
            return adapter
        except AdapterError as exc:
            raise InvalidRequestError(str(exc), "model") from exc

    def abort(self, request_id: str) -> list[Chunk]:
        """Stop a request (every choice) now and free its blocks; returns the final chunks of
        the choices still running, none if the request is unknown."""
        family = self._families.pop(request_id, None)
        if family is None:
            return []
        parked = {id(seq) for seq in family.parked}
        finals = []
        for seq_id in family.seq_ids:
            out = self._outputs.pop(seq_id, None)
            if out is None:
                continue  # this choice had finished
            if id(out.seq) in parked:
                out.seq.status = SequenceStatus.FINISHED
                out.seq.finished_s = time.time()
            else:
                self.scheduler.finish(out.seq, FinishReason.ABORT)
            finals.append(out.chunk((), None, FinishReason.ABORT))
        return finals

    def abort_all(self) -> list[Chunk]:
        return [c for rid in list(self._families) for c in self.abort(rid)]

    # ---- the step --------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Chunk]:
        self._num_steps += 1
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        sampling = [s.seq for s in output.scheduled if s.is_sampling]
        logits = self.runner.execute(output.scheduled)
        self.scheduler.update_after_step(output)
        if not sampling:
            return []
        samples = self.sampler.sample(logits, sampling)
        return self._emit(output, sampling, samples)

    def _emit(self, output: SchedulerOutput, seqs: list[Sequence], samples: list) -> list[Chunk]:
        now = time.time()
        chunks = []
        for seq, sample in zip(seqs, samples, strict=True):
            seq.append_token(sample.token_id)
            out = self._outputs[seq.request_id]
            if seq.first_token_s is None:
                seq.first_token_s = now
                self._release_siblings(out.request_id)
            finish = out.on_token(sample.token_id, self.max_model_len)
            if finish is not None:
                self._finish(out, finish)
            logprobs = (sample.logprob,) if sample.logprob is not None else None
            chunks.append(out.chunk((sample.token_id,), logprobs, finish))
        return chunks

    def _release_siblings(self, request_id: str) -> None:
        """The first choice's prompt is computed (and cached): schedule the other choices."""
        family = self._families.get(request_id)
        if family is not None and family.parked:
            for seq in family.parked:
                self.scheduler.add(seq)
            family.parked = []

    def _finish(self, out: RequestOutput, finish: FinishReason) -> None:
        self.scheduler.finish(out.seq, finish)
        del self._outputs[out.seq.request_id]
        family = self._families[out.request_id]
        if all(seq_id not in self._outputs for seq_id in family.seq_ids):
            del self._families[out.request_id]

    @property
    def progress(self) -> int:
        """Steps and model layers run so far; safe to read from any thread."""
        return self._num_steps + self.runner.model.num_layers_run

    def load(self) -> LoadSnapshot:
        running, waiting = self.scheduler.num_running, self.scheduler.num_waiting
        return LoadSnapshot(
            num_running=running,
            num_waiting=waiting,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            num_total_kv_blocks=self.block_manager.num_total_blocks,
            num_free_slots=max(0, self.config.max_num_seqs - running - waiting),
            num_steps=self._num_steps,
            progress=self.progress,
            compute=f"torch {self.compute.describe()}",
            adapters=tuple(self.adapters.loaded),
        )


def _choice(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of a request: one sequence; seeded with ``seed + index`` (vLLM's rule)."""
    if sampling.n == 1:
        return sampling
    seed = None if sampling.seed is None else sampling.seed + index
    if seed is not None and seed >= 2**64:
        seed -= 2**64  # the same generator seed: the sampler takes it modulo 2**64
    return dataclasses.replace(sampling, n=1, seed=seed)


def _prompt_param(request: GenerateRequest) -> str:
    return "messages" if request.messages is not None else "prompt"
