"""Where and in what precision the engine computes: ``device: auto`` and ``dtype: auto`` resolved
on the machine the engine runs on (a replica's host, not the one that read the settings).

NOTE: bfloat16 halves the bytes every decode step streams, but only pays where the hardware
computes it: on a GPU with bf16 (Ampere and later), and on a CPU with AVX-512 BF16 or AMX.
Elsewhere torch emulates bf16 matmuls through float32 conversions, measured at ~1.2 GFLOP/s on
an AVX2-only machine: many times slower than float32.

On a CPU, ``auto`` is bfloat16 only where it is native *and* fairserve's CPU kernels run
(replicas/torch_engine/kernels): through torch's own ops a query row's attention in bf16 rounds
differently when computed in a prefill chunk than in a decode step, so a migrated request
(resumed by a prefill of the tokens already sent) would not go on with the text it would have
had, which fairserve promises (README "What a client may rely on"). The kernels compute each
row alone, the same way in any batch, which keeps that promise in bf16. Without them ``auto``
is float32 (``dtype: bfloat16`` still gives the speed, without the promise). The choice and its
reason are logged and published in the replica's load report, so ``fairserve status`` shows
what each replica runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from replicas.engine.config import AUTO, DType, EngineConfig, Quantization
from replicas.torch_engine import kernels
from replicas.torch_engine.models.cpu_int4 import has_int4_kernel
from replicas.torch_engine.models.cpu_linear import can_pack

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class ComputeChoice:
    device: torch.device
    dtype: DType
    reason: str  # why this dtype, for the log and `fairserve status`
    uses_cpu_kernels: bool = False
    quantization: Quantization = Quantization.NONE

    def describe(self) -> str:
        """``cpu bfloat16 int4``: what ``fairserve status`` shows per replica."""
        quantized = "" if self.quantization is Quantization.NONE else f" {self.quantization.value}"
        return f"{self.device} {self.dtype.value}{quantized}"


def with_quantization(choice: ComputeChoice, config: EngineConfig) -> ComputeChoice:
    """``choice`` with ``engine.quantization`` resolved (reading the model file's weight types
    only when ``auto`` could pick int4); logged once."""
    file_bits = None
    if (config.quantization is Quantization.AUTO and choice.dtype is DType.BFLOAT16
            and config.model.lower().endswith(".gguf")):
        from replicas.torch_engine.loader.gguf_loader import layer_weight_bits

        file_bits = layer_weight_bits(config.model)
    quantization, reason = resolve_quantization(config.quantization, choice, file_bits)
    if quantization is not Quantization.NONE or config.quantization is not Quantization.NONE:
        logger.info("engine weights %s: %s", quantization.value, reason)
    return replace(choice, quantization=quantization)


def resolve_quantization(requested: Quantization, choice: ComputeChoice,
                         file_bits: int | None) -> tuple[Quantization, str]:
    """int4 or none, and why. ``file_bits``: bits per weight of the model file's layers
    (``loader.gguf_loader.layer_weight_bits``; None: not a GGUF). Raises ``ValueError`` naming
    the setting when int4 is asked where it cannot run."""
    runs_int4 = (choice.device.type == "cpu" and choice.dtype is DType.BFLOAT16
                 and has_int4_kernel())
    if requested is Quantization.NONE:
        return Quantization.NONE, "set in the settings"
    if requested is Quantization.INT4:
        if not (runs_int4 and choice.uses_cpu_kernels):
            raise ValueError(
                f"engine.quantization int4 needs a CPU engine in bfloat16 with fairserve's CPU "
                f"kernels (this one runs on {choice.device} in {choice.dtype.value}, kernels "
                f"{'on' if choice.uses_cpu_kernels else 'off'}); set dtype bfloat16 on a CPU "
                "with native bf16 and cpu_kernels true, or quantization none")
        return Quantization.INT4, "set in the settings"
    if not (runs_int4 and choice.uses_cpu_kernels):
        return Quantization.NONE, "int4 runs only on a CPU engine in bfloat16 with its kernels"
    if file_bits is None or file_bits > 4:
        return Quantization.NONE, f"the model file's layers are not 4-bit ({file_bits or 'not a GGUF'})"
    return Quantization.INT4, (f"the model file's layers are {file_bits}-bit: int4 keeps them "
                               "at a quarter of bfloat16's bytes")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo); empty elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def resolve_device(requested: str) -> torch.device:
    if requested != AUTO:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(requested: DType, device: torch.device, flags: frozenset[str],
                  has_cpu_kernels: bool = False) -> tuple[DType, str]:
    """The dtype to run in and why; ``flags`` are the CPU's (see ``cpu_flags``)."""
    if requested is not DType.AUTO:
        return requested, "set in the settings"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DType.BFLOAT16, "a GPU with bfloat16"
        return DType.FLOAT16, "a GPU without bfloat16"
    native = sorted(CPU_BF16_FLAGS & flags)
    if native and has_cpu_kernels:
        return DType.BFLOAT16, (
            f"the CPU computes bfloat16 natively ({', '.join(native)}) and fairserve's CPU "
            "kernels keep each request's text independent of its batch")
    if native:
        return DType.FLOAT32, (
            f"the CPU computes bfloat16 natively ({', '.join(native)}), but without fairserve's "
            "CPU kernels only float32 keeps a migrated request's text exact; dtype: bfloat16 for "
            "the speed")
    return DType.FLOAT32, "the CPU has no native bfloat16 (no avx512_bf16 or amx_bf16)"


def choose(config: EngineConfig) -> ComputeChoice:
    device = resolve_device(config.device)
    flags = cpu_flags() if device.type == "cpu" else frozenset()
    has_kernels = device.type == "cpu" and config.cpu_kernels and kernels.cpu_ops().is_available
    dtype, reason = resolve_dtype(config.dtype, device, flags, has_kernels)
    # the kernels take the packed linears' 2-D rows (models/llama.py): float32 and bfloat16
    uses_kernels = has_kernels and can_pack(device, TORCH_DTYPES[dtype.value])
    logger.info("engine computes on %s in %s%s: %s", device, dtype.value,
                " with fairserve's CPU kernels" if uses_kernels else "", reason)
    return ComputeChoice(device, dtype, reason, uses_kernels)
