"""Reading a GGUF file (llama.cpp's format): its ModelConfig and its weights.

Weights are dequantized to float32 (``gguf.quants.dequantize``), reshaped to PyTorch's
``(out, in)`` order (the reverse of GGUF's dimension list) and renamed to the engine's
parameter names (``replicas.torch_engine.loader.weight_names``). Supported architectures: ``llama``
(which llama.cpp also uses for Mistral models) and ``qwen2``.

NOTE: llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head for the ``llama``
architecture, while Hugging Face's ``rotate_half`` pairs x_i with x_{i + head_dim/2}. Its
converter therefore permutes the rows of attn_q and attn_k (weight and bias) within each head,
from HF's order [0 .. d/2-1 | d/2 .. d-1] to the interleaved [0, d/2, 1, d/2+1, ...]. We undo
it, as transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does: view the rows of
each head (attn_k: each KV head) as (head_dim/2, 2) and transpose to (2, head_dim/2). ``qwen2``
uses llama.cpp's NEOX rotation, the same as HF's, so its files are not permuted.

NOTE: a Llama 3.x GGUF holds its "llama3" RoPE scaling not as metadata but as a
``rope_freqs.weight`` tensor of per-frequency divisors. We recover transformers'
``rope_scaling`` dict from it by trying the parameter sets Llama 3.x ships with and keeping
the one that reproduces the tensor; a file that matches none is refused.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replicas.engine.errors import ModelLoadError
from replicas.torch_engine.loader.weight_names import check_weight_shapes
from replicas.torch_engine.models.model_config import ModelConfig, normalize_token_ids

GGUF_ARCHITECTURES = ("llama", "qwen2")
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of Llama 3.1 and 3.2
LLAMA3_ROPE_CANDIDATES = ((1.0, 4.0, 8192),)

_GLOBAL_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_READ_ERRORS = (OSError, ValueError, IndexError, KeyError, TypeError)


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF file: its config and its (not yet read) tensors."""

    path: str
    config: ModelConfig
    tensors: tuple[Any, ...]  # gguf.ReaderTensor, data still memory-mapped

    def weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """``(our name, tensor)`` for every weight, dequantized, in ``dtype``."""
        for tensor in self.tensors:
            name = engine_name(tensor.name)
            if name is None:
                continue  # rope_freqs.weight: folded into config.rope_scaling
            yield name, self._read(tensor, name).to(dtype)

    def _read(self, tensor: Any, name: str) -> torch.Tensor:
        values = _dequantize(tensor, self.path)
        weight = torch.from_numpy(values).reshape(torch_shape(tensor))
        cfg = self.config
        if cfg.architecture == "llama" and ".self_attn.q_proj." in name:
            weight = reverse_rotary_permutation(weight, cfg.num_heads)
        elif cfg.architecture == "llama" and ".self_attn.k_proj." in name:
            weight = reverse_rotary_permutation(weight, cfg.num_kv_heads)
        return weight


def open_gguf(path: str) -> GGUFCheckpoint:
    """Parse the file's metadata and tensor table; raise ModelLoadError naming ``path``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"not a readable GGUF file ({exc})", path) from exc
    metadata = _scalar_metadata(reader)
    tensors = tuple(reader.tensors)
    try:
        config = gguf_model_config(metadata, _vocab_length(reader), tensors, path)
    except (ValueError, TypeError) as exc:  # ModelConfig's own checks, non-numeric metadata
        raise ModelLoadError(f"unsupported GGUF metadata ({exc})", path) from exc
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in tensors:
        name = engine_name(tensor.name)
        if name is not None:
            shapes[name] = torch_shape(tensor)
        elif tensor.name != ROPE_FREQS_TENSOR:
            raise ModelLoadError(f"unexpected GGUF tensor {tensor.name!r}", path)
    check_weight_shapes(shapes, config, path)
    return GGUFCheckpoint(path=path, config=config, tensors=tensors)


def layer_weight_bits(path: str) -> int | None:
    """Bits per weight of most of the file's decoder-layer matrices (by parameter count): 4 for
    Q4_0/Q4_1/Q4_K (and Q4_K_M, whose few Q6_K tensors are outnumbered), 8 for Q8_0, 16 for
    F16; ``None`` where the file cannot be read or holds no such tensors."""
    import gguf

    try:
        tensors = tensor_types(path)
        counts: dict[int, int] = {}
        for name, dims, type_id in tensors:
            if name.startswith("blk.") and len(dims) == 2:
                bits = _type_bits(gguf.GGMLQuantizationType(type_id).name)
                counts[bits] = counts.get(bits, 0) + dims[0] * dims[1]
    except _READ_ERRORS:
        return None
    return max(counts, key=lambda bits: counts[bits]) if counts else None


# GGUF metadata value types (the file format's numbering) -> size in bytes; 8: string, 9: array
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def tensor_types(path: str) -> list[tuple[str, tuple[int, ...], int]]:
    """Every tensor's (name, dims as stored, GGML type id), read from the header alone.

    NOTE: ``gguf.GGUFReader`` builds every metadata field, a Python object per element: the
    default model's 49,152-token vocabulary and its merges took ~2 s here, on every replica
    start, to learn the layers' weight types (``quantization: auto``). This walks the same
    header (GGUF v2/v3, little-endian) skipping the metadata by its lengths: 0.03 s. Raises
    ``ValueError`` for a file that is not such a GGUF (or is empty) or ends early."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)  # only the header's pages are read
        try:
            return _tensor_infos(view)
        finally:
            view.release()


def _tensor_infos(data: memoryview) -> list[tuple[str, tuple[int, ...], int]]:
    header = _Header(data)
    if bytes(data[:4]) != b"GGUF" or header.u32(4) not in (2, 3):
        raise ValueError("not a GGUF v2/v3 file")
    num_tensors, num_fields = header.u64(8), header.u64(16)
    at = 24
    for _ in range(num_fields):
        at += 8 + header.u64(at)  # the key
        at = header.skip_value(at + 4, header.u32(at))
    tensors = []
    for _ in range(num_tensors):
        length = header.u64(at)
        name = bytes(data[at + 8:at + 8 + length]).decode("utf-8")
        at += 8 + length
        num_dims = header.u32(at)
        dims = tuple(header.u64(at + 4 + 8 * i) for i in range(num_dims))
        at += 4 + 8 * num_dims
        tensors.append((name, dims, header.u32(at)))
        at += 12  # the type and the data offset
    return tensors


class _Header:
    """Little-endian reads at byte offsets of a GGUF header; past its end: ``ValueError``."""

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def u32(self, at: int) -> int:
        return self._uint(at, 4)

    def u64(self, at: int) -> int:
        return self._uint(at, 8)

    def skip_value(self, at: int, value_type: int) -> int:
        """The offset after a metadata value of ``value_type`` starting at ``at``."""
        if value_type in _GGUF_SCALAR_SIZES:
            return at + _GGUF_SCALAR_SIZES[value_type]
        if value_type == _GGUF_STRING:
            return at + 8 + self.u64(at)
        if value_type != _GGUF_ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type}")
        element_type, count = self.u32(at), self.u64(at + 4)
        at += 12
        if element_type in _GGUF_SCALAR_SIZES:
            return at + count * _GGUF_SCALAR_SIZES[element_type]
        for _ in range(count):
            at = self.skip_value(at, element_type)
        return at

    def _uint(self, at: int, size: int) -> int:
        if at + size > len(self.data):
            raise ValueError("the GGUF header ends early")
        return int.from_bytes(self.data[at:at + size], "little")


def _type_bits(type_name: str) -> int:
    """GGML type name -> bits of its codes (F32 32, F16/BF16 16, Q8_0 8, Q4_1 4, IQ2_XS 2)."""
    match = re.match(r"I?Q(\d)", type_name)
    if match:
        return int(match.group(1))
    return 32 if type_name == "F32" else 16


def gguf_model_config(
    metadata: dict[str, Any], vocab_length: int | None, tensors: tuple[Any, ...], path: str
) -> ModelConfig:
    """A ModelConfig from a GGUF file's scalar metadata and tensor table."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHITECTURES})", path
        )

    def key(suffix: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{suffix}", path)
        return value

    names = {t.name for t in tensors}
    hidden_size, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(
        metadata.get(f"{arch}.attention.key_length")
        or metadata.get(f"{arch}.rope.dimension_count")
        or hidden_size // num_heads
    )
    rope_dim = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"partial rotary ({rope_dim} of {head_dim} dims) is unsupported", path)
    max_positions = int(key("context_length"))
    rope_theta = float(key("rope.freq_base", 10000.0))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(key("vocab_size", vocab_length)),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        sliding_window=None,
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(metadata, arch, tensors, (rope_theta, head_dim), path),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=normalize_token_ids(
            [
                metadata[k]
                for k in (
                    "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.eom_token_id",
                )
                if k in metadata
            ]
        ),
    )


def engine_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name; None for rope_freqs and unknown tensors."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, suffix = match.groups()
    return f"layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"


def torch_shape(tensor: Any) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-moving first; PyTorch the other way round."""
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))


def reverse_rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of attn_q/attn_k (see the module NOTE)."""
    # (num_heads * head_dim, *rest) -> (num_heads, head_dim/2, 2, *rest) -> (num_heads, 2, ...)
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape).contiguous()


def _dequantize(tensor: Any, path: str) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"cannot dequantize tensor {tensor.name!r} ({exc})", path) from exc
    # F32 comes back as a read-only view of the memory map; torch needs memory of its own
    return np.array(values, dtype=np.float32, copy=True)


def _scalar_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata value that is not an array (arrays are the tokenizer's, and large)."""
    import gguf

    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        metadata[name] = value
    return metadata


def _vocab_length(reader: Any) -> int | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    return None if field is None else len(field.data)


def _rope_scaling(
    metadata: dict[str, Any],
    arch: str,
    tensors: tuple[Any, ...],
    rope: tuple[float, int],
    path: str,
) -> dict[str, Any] | None:
    """transformers' rope_scaling dict from the ``{arch}.rope.scaling.*`` keys or rope_freqs."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind is None and f"{arch}.rope.scale_linear" in metadata:  # older files
        kind, factor = "linear", float(metadata[f"{arch}.rope.scale_linear"])
    freqs = next((t for t in tensors if t.name == ROPE_FREQS_TENSOR), None)
    if freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"GGUF has both rope_freqs and rope scaling {kind!r}", path)
        return _llama3_scaling(_dequantize(freqs, path), rope, path)
    if kind in (None, "none") or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise ModelLoadError(f"GGUF rope scaling type {kind!r} is not supported", path)
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{gguf_key}" in metadata:
            scaling[hf_key] = float(metadata[f"{arch}.rope.scaling.{gguf_key}"])
    return scaling


def _llama3_scaling(
    freq_divisors: np.ndarray, rope: tuple[float, int], path: str
) -> dict[str, Any]:
    """The llama3 rope_scaling whose per-frequency divisors equal the file's rope_freqs."""
    theta, head_dim = rope
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(np.round(freq_divisors.max()))
    for low, high, original in LLAMA3_ROPE_CANDIDATES:
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        divisors = np.where(
            wavelen < high_wavelen,
            1.0,
            np.where(wavelen > low_wavelen, factor, 1.0 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(divisors, freq_divisors, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ModelLoadError("GGUF rope_freqs matches no known llama3 RoPE scaling", path)
