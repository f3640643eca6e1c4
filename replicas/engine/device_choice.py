"""Where and in what precision the engine computes: ``device: auto`` and ``dtype: auto`` resolved
on the machine the engine runs on (a replica's host, not the one that read the settings).

NOTE: bfloat16 halves the bytes every decode step streams, but only pays where the hardware
computes it: on a GPU with bf16 (Ampere and later), and on a CPU with AVX-512 BF16 or AMX.
Elsewhere torch emulates bf16 matmuls through float32 conversions, measured at ~1.2 GFLOP/s on
an AVX2-only machine: many times slower than float32.

On a CPU, ``auto`` is bfloat16 only where it is native *and* fairserve's CPU kernels run
(replicas/engine/kernels): through torch's own ops a query row's attention in bf16 rounds
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
from dataclasses import dataclass
from pathlib import Path

import torch

from replicas.engine import kernels
from replicas.engine.config import AUTO, DType, EngineConfig

logger = logging.getLogger(__name__)

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class ComputeChoice:
    device: torch.device
    dtype: DType
    reason: str  # why this dtype, for the log and `fairserve status`
    uses_cpu_kernels: bool = False


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
    uses_kernels = has_kernels and dtype in (DType.FLOAT32, DType.BFLOAT16)
    logger.info("engine computes on %s in %s%s: %s", device, dtype.value,
                " with fairserve's CPU kernels" if uses_kernels else "", reason)
    return ComputeChoice(device, dtype, reason, uses_kernels)
