"""The Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One module serves the family: Qwen2 differs by q/k/v biases, Mistral by a sliding window
(applied in the attention masks the model runner builds), Llama 3 by RoPE scaling. q/k/v and
gate/up are fused into one matmul each (fewer, larger GEMMs run faster on CPU); weights
arrive under Hugging Face's unfused names and ``load_weights`` packs them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from replicas.torch_engine.attention import AttentionMetadata, KernelMetadata, paged_attention
from replicas.torch_engine.lora import LoraBatch
from replicas.torch_engine.models.cpu_int4 import SplitLinear, split_linears
from replicas.torch_engine.models.cpu_linear import pack_linears
from replicas.torch_engine.models.model_config import ModelConfig
from replicas.torch_engine.models.rope import rope_inv_freq


def uninitialized_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An ``nn.Linear`` with its parameters allocated but not initialised.

    Every parameter of the model is overwritten by ``load_weights`` (which raises if the
    checkpoint lacks one), so the random init is skipped: for the 135M default model it cost
    about 0.9 s of a replica's start. Built on the meta device, then given real memory.
    """
    return nn.Linear(in_features, out_features, bias=bias, device="meta").to_empty(device="cpu")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm: normalise in float32, then scale.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up once per step."""

    cos: torch.Tensor  # (max_positions, head_dim // 2)
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(cfg)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim // 2)
        # transformers takes cos/sin of cat(freqs, freqs); both halves are equal, keep one.
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._float_tables = (cos.clone(), sin.clone())

    def float_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin in float32 on the CPU (the kernels' arithmetic), whatever the model was cast
        to: plain attributes, so ``Module.to`` leaves them as computed."""
        return self._float_tables

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens,) -> cos, sin of shape (num_tokens, 1, head_dim // 2)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, written half by half (no concatenation).

    x: (num_tokens, num_heads, head_dim); cos, sin: (num_tokens, 1, head_dim // 2). Per element
    this is exactly transformers' arithmetic: the first half is x1*c + (-x2)*s.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.addcmul(x1 * cos, -x2, sin, out=out[..., :half])
    torch.addcmul(x2 * cos, x1, sin, out=out[..., half:])
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = uninitialized_linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = cfg.attention_bias and cfg.architecture != "qwen2"
        self.o_proj = uninitialized_linear(self.q_size, cfg.hidden_size, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,  # (num_tokens, hidden)
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: _Lora,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = lora("qkv", x, self.qkv_proj(x)).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta).reshape(num_tokens,
                                                                            self.q_size)
        return lora("o", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = uninitialized_linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias
        )
        self.down_proj = uninitialized_linear(cfg.intermediate_size, cfg.hidden_size,
                                              bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: _Lora) -> torch.Tensor:
        gate, up = lora("gate_up", x, self.gate_up_proj(x)).split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        return lora("down", h, self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: _Lora,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


def _project(linear: nn.Module, x: torch.Tensor, num_generated: int) -> torch.Tensor:
    if isinstance(linear, SplitLinear):
        return linear(x, num_generated)
    return linear(x)


class _Lora:
    """One layer's LoRA updates in a step: ``lora(projection, x, y)`` adds them to ``y`` (the
    base projection of ``x``); with no adapter in the step it returns ``y`` as it is."""

    __slots__ = ("batch", "layer")

    def __init__(self, batch: LoraBatch | None, layer: int) -> None:
        self.batch, self.layer = batch, layer

    def __call__(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.batch is None:
            return y
        return self.batch.apply(self.layer, projection, x, y)


class LlamaForCausalLM(nn.Module):
    """The decoder. Built with its parameters allocated but not initialised (only the rotary
    tables are computed): ``load_weights`` fills every one, and raises if any is missing."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # left uninitialised, as the projections (see uninitialized_linear)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else uninitialized_linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.uses_cpu_kernels = False
        # layers run so far (every step's): the engine's sign of life inside a long step, read
        # from another thread (an int's update is atomic under the GIL)
        self.num_layers_run = 0

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | KernelMetadata,
        lora: LoraBatch | None = None,  # the rows of LoRA adapters, if any (../lora.py)
    ) -> torch.Tensor:  # (num_tokens, hidden): final hidden states, before the norm
        if isinstance(meta, KernelMetadata):
            return self._forward_cpu_kernels(input_ids, kv_caches, meta, lora)
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, rope, kv_cache, meta, _Lora(lora, i))
            self.num_layers_run += 1
        return x

    def _forward_cpu_kernels(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: KernelMetadata,
        lora_batch: LoraBatch | None,
    ) -> torch.Tensor:
        """The same decoder through ``torch.ops.fairserve`` (replicas/torch_engine/kernels): each
        layer is 4 packed linears and 4 kernels (norm, attention with RoPE and the cache write,
        residual add + norm, SiLU-and-multiply) instead of ~165 small torch ops, and every row's
        result is independent of the batch around it (see cpu_ops.cpp)."""
        ops, cfg = torch.ops.fairserve, self.cfg
        eps, window = cfg.rms_norm_eps, cfg.sliding_window or 0
        scale = cfg.head_dim ** -0.5
        cos, sin = self.rotary.float_tables()
        x = self.embed_tokens(input_ids)  # (num_tokens, hidden), the residual stream
        layers = cast(list[DecoderLayer], list(self.layers))
        g = meta.num_generated
        h = ops.rms_norm(x, layers[0].input_layernorm.weight, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            lora = _Lora(lora_batch, i)
            a = ops.paged_attention(
                lora("qkv", h, _project(attn.qkv_proj, h, g)), meta.positions, cos, sin,
                k_cache, v_cache,
                meta.slot_mapping, meta.token_seq, meta.block_tables, cfg.num_heads,
                cfg.num_kv_heads, window, scale,
            )
            h = ops.add_rms_norm(x, lora("o", a, _project(attn.o_proj, a, g)),
                                 layer.post_attention_layernorm.weight, eps)
            act = ops.silu_mul(lora("gate_up", h, _project(mlp.gate_up_proj, h, g)))
            m = lora("down", act, _project(mlp.down_proj, act, g))
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, m, layers[i + 1].input_layernorm.weight, eps)
            else:
                x.add_(m)
            self.num_layers_run += 1
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_sampled, hidden) hidden states of sampling positions -> (num_sampled, vocab)."""
        if self.uses_cpu_kernels:
            hidden = torch.ops.fairserve.rms_norm(hidden.contiguous(), self.norm.weight,
                                                  self.cfg.rms_norm_eps)
        else:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    def pack_for_cpu(self) -> None:
        """Swap every projection (and the vocabulary head) for oneDNN-packed ones."""
        if self.lm_head is None:  # tied: the head gets its own packed copy of the embedding
            self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False,
                                     device="meta")
            self.lm_head.weight = self.embed_tokens.weight
        pack_linears(self)

    def quantize_int4(self) -> None:
        """The decoder layers' projections also in 4-bit groups, for generated-token rows
        (models/cpu_int4.py ``SplitLinear``), from the float32 weights: call after
        ``load_weights``, before casting to bfloat16; runs only through the CPU kernels. The
        vocabulary head stays as it is."""
        split_linears(self.layers)

    def use_cpu_kernels(self) -> None:
        """Run ``forward`` through fairserve's CPU kernels (loaded by the caller); the runner
        then hands ``KernelMetadata``. Call after ``pack_for_cpu``: the kernels take 2-D
        contiguous rows, which the packed linears give."""
        self.uses_cpu_kernels = True

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named weights in, packing q/k/v and gate/up into fused params.

        Raises ``KeyError`` naming a weight the model does not have, ``ValueError`` naming a
        weight of the wrong shape or the weights the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        packs = self._packing()
        expected: set[str] = set()
        for name in params:
            parts = [hf for hf, (fused, _, _) in packs.items() if f".{fused}." in name]
            expected.update(name.replace(packs[hf][0], hf) for hf in parts)
            if not parts:
                expected.add(name)
        seen: set[str] = set()
        for name, tensor in weights:
            dest = self._destination(name, params, packs)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")

    def _packing(self) -> dict[str, tuple[str, int, int]]:
        """Hugging Face sub-module -> (fused sub-module, first row, end row)."""
        q_size = self.cfg.num_heads * self.cfg.head_dim
        kv_size = self.cfg.num_kv_heads * self.cfg.head_dim
        inter = self.cfg.intermediate_size
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_size, q_size + kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, q_size + 2 * kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
        }

    @staticmethod
    def _destination(
        name: str, params: dict[str, nn.Parameter], packs: dict[str, tuple[str, int, int]]
    ) -> torch.Tensor:
        for hf, (fused, start, end) in packs.items():
            if f".{hf}." in name:
                return params[name.replace(hf, fused)].narrow(0, start, end - start)
        if name not in params:
            raise KeyError(f"unexpected weight {name!r}")
        return params[name]
