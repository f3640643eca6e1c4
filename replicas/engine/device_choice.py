"""Where and in what precision the engine computes: ``device: auto`` and ``dtype: auto`` resolved
on the machine the engine runs on (a replica's host, not the one that read the settings).

NOTE: bfloat16 halves the bytes every decode step streams, but only pays where the hardware
computes it: on a GPU with bf16 (Ampere and later), and on a CPU with AVX-512 BF16 or AMX.
Elsewhere torch emulates bf16 matmuls through float32 conversions, measured at ~1.2 GFLOP/s on
an AVX2-only machine: many times slower than float32.

On a CPU, ``auto`` is float32 even where bf16 is native (1.8x the engine's throughput at 32
streams on a 2-core Xeon with AMX): in bf16 a query row's attention rounds differently when
computed in a prefill chunk than in a decode step, so a migrated request (resumed by a prefill
of the tokens already sent) would not go on with the text it would have had, which fairserve
promises (README "What a client may rely on"). ``dtype: bfloat16`` gives the speed without that
promise. The choice and its reason are logged and published in the replica's load report, so
``fairserve status`` shows what each replica runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from replicas.engine.config import AUTO, DType, EngineConfig

logger = logging.getLogger(__name__)

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class ComputeChoice:
    device: torch.device
    dtype: DType
    reason: str  # why this dtype, for the log and `fairserve status`


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


def resolve_dtype(requested: DType, device: torch.device, flags: frozenset[str]) -> tuple[DType, str]:
    """The dtype to run in and why; ``flags`` are the CPU's (see ``cpu_flags``)."""
    if requested is not DType.AUTO:
        return requested, "set in the settings"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DType.BFLOAT16, "a GPU with bfloat16"
        return DType.FLOAT16, "a GPU without bfloat16"
    native = sorted(CPU_BF16_FLAGS & flags)
    if native:
        return DType.FLOAT32, (
            f"the CPU computes bfloat16 natively ({', '.join(native)}), but only float32 keeps "
            "a migrated request's text exact; dtype: bfloat16 for the speed")
    return DType.FLOAT32, "the CPU has no native bfloat16 (no avx512_bf16 or amx_bf16)"


def choose(config: EngineConfig) -> ComputeChoice:
    device = resolve_device(config.device)
    flags = cpu_flags() if device.type == "cpu" else frozenset()
    dtype, reason = resolve_dtype(config.dtype, device, flags)
    logger.info("engine computes on %s in %s: %s", device, dtype.value, reason)
    return ComputeChoice(device, dtype, reason)
