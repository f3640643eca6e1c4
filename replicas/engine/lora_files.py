"""A PEFT LoRA adapter's files, checked without torch: ``adapter_config.json`` (rank, scale,
the options fairserve supports) and the names, shapes and dtypes in the header of
``adapter_model.safetensors``. The engine reads the weights themselves (``lora.py``); the CLI
checks a directory here before it registers it (``fairserve adapters add``), so a bad adapter
is refused where it is added, naming the file and the field, not at its first request."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 256
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                 r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")
FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class AdapterError(ValueError):
    """An adapter that cannot be used with this model; the message names the file and field."""


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    modules: frozenset[str]  # the Hugging Face modules it updates
    num_layers: int  # 1 + the highest layer it names


def read_config(config_file: Path, name: str) -> tuple[int, float]:
    """The adapter's rank and scale, from ``adapter_config.json``."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} is not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: {config_file}: peft_type "
                           f"{config.get('peft_type')!r} is not LORA")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= MAX_RANK:
        raise AdapterError(f"adapter {name!r}: {config_file}: r must be 1..{MAX_RANK}, "
                           f"not {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"adapter {name!r}: {config_file}: lora_alpha must be a number, "
                           f"not {alpha!r}")
    for key, allowed in (("fan_in_fan_out", (False, None)), ("bias", ("none", None)),
                         ("use_dora", (False, None)), ("modules_to_save", (None, [])),
                         ("rank_pattern", (None, {})), ("alpha_pattern", (None, {}))):
        if config.get(key) not in allowed:
            raise AdapterError(f"adapter {name!r}: {config_file}: {key}={config.get(key)!r} "
                               "is not supported")
    return rank, float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def parse_key(key: str, weights_file: Path, name: str) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor's name; ``AdapterError`` for another."""
    match = KEY.match(key)
    if match is None or match.group(2) not in MODULES:
        raise AdapterError(f"adapter {name!r}: {weights_file}: unexpected tensor {key!r} "
                           f"(LoRA on {', '.join(MODULES)} of the decoder layers only)")
    return int(match.group(1)), match.group(2), match.group(3)


def check_adapter_dir(path: Path, name: str) -> AdapterFiles:
    """The adapter in ``path``, checked as far as its files go without the model: its
    config, and in its weights' header every tensor's name, dtype and rank, each module with
    its A and its B."""
    rank, scale = read_config(path / CONFIG_FILE, name)
    weights_file = path / WEIGHTS_FILE
    try:
        with weights_file.open("rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(file.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {weights_file}: {exc}") from exc
    sides: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        layer, module, side = parse_key(key, weights_file, name)
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(info, dict) or info.get("dtype") not in FLOAT_DTYPES or \
                not isinstance(shape, list) or len(shape) != 2:
            raise AdapterError(f"adapter {name!r}: {weights_file}: {key!r} must be a 2-D "
                               f"tensor of {', '.join(FLOAT_DTYPES)}")
        if shape[0 if side == "A" else 1] != rank:
            raise AdapterError(f"adapter {name!r}: {weights_file}: {key!r} has shape {shape}; "
                               f"lora_{side} of rank {rank} (r in {CONFIG_FILE}) is "
                               + ("(r, in)" if side == "A" else "(out, r)"))
        sides.setdefault((layer, module), {})[side] = shape
    if not sides:
        raise AdapterError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    for (layer, module), pair in sorted(sides.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {weights_file}: layer {layer} {module} has "
                               f"lora_{''.join(pair)} only")
    return AdapterFiles(rank, scale, frozenset(m for _, m in sides),
                        1 + max(layer for layer, _ in sides))
