"""Reading a Hugging Face checkpoint directory: ``config.json`` plus ``*.safetensors``.

The config goes through ``transformers.AutoConfig`` (offline) and ``from_hf_config``; EOS ids
from ``generation_config.json`` are added to the config's. Weights are read from the
safetensors files (sharded ones through ``model.safetensors.index.json``), renamed to the
engine's names by dropping the ``model.`` prefix, and converted to the requested dtype one
tensor at a time. Rotary ``inv_freq`` buffers, and ``lm_head.weight`` of a tied model, are
skipped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from replicas.engine.errors import ModelLoadError
from replicas.torch_engine.loader.weight_names import check_weight_shapes
from replicas.torch_engine.models.model_config import (
    ModelConfig,
    from_hf_config,
    normalize_token_ids,
)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# safetensors file -> ((key in the file, our name), ...), in file order
Layout = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


@dataclass(frozen=True)
class HFCheckpoint:
    """An opened checkpoint directory: its config and where each weight lives."""

    path: str
    config: ModelConfig
    layout: Layout

    def weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """``(our name, tensor)`` for every weight, in ``dtype``."""
        from safetensors import SafetensorError, safe_open

        for file, entries in self.layout:
            try:
                with safe_open(file, framework="pt") as handle:
                    for key, name in entries:
                        yield name, handle.get_tensor(key).to(dtype)
            except (OSError, SafetensorError) as exc:
                raise ModelLoadError(f"cannot read safetensors ({exc})", file) from exc


def open_hf_dir(path: str) -> HFCheckpoint:
    """Read the config and the safetensors headers; raise ModelLoadError naming the path."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise ModelLoadError(f"model directory has no {CONFIG_FILE}", path)
    config = _model_config(path)
    files = _safetensors_files(directory)
    layout, shapes = safetensors_layout(files, config)
    check_weight_shapes(shapes, config, path)
    return HFCheckpoint(path=path, config=config, layout=layout)


def engine_name(checkpoint_key: str, config: ModelConfig) -> str | None:
    """Our name for a checkpoint tensor, or None for one the engine does not load."""
    if checkpoint_key.endswith("rotary_emb.inv_freq"):
        return None
    name = checkpoint_key.removeprefix("model.")
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    return name


def _model_config(path: str) -> ModelConfig:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        config = from_hf_config(hf_config)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"unsupported or unreadable {CONFIG_FILE} ({exc})", path) from exc
    extra_eos = _generation_eos_token_ids(Path(path) / GENERATION_CONFIG_FILE)
    eos_token_ids = normalize_token_ids([*config.eos_token_ids, *extra_eos])
    return dataclasses.replace(config, eos_token_ids=eos_token_ids)


def _generation_eos_token_ids(file: Path) -> tuple[int, ...]:
    if not file.is_file():
        return ()
    try:
        generation = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable {GENERATION_CONFIG_FILE} ({exc})", str(file)) from exc
    return normalize_token_ids(generation.get("eos_token_id"))


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / SAFETENSORS_INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"unreadable safetensors index ({exc})", str(index)) from exc
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError("safetensors shard named in the index is missing", str(file))
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError("model directory has no *.safetensors files", str(directory))
    return files


def safetensors_layout(files: list[Path], config: ModelConfig) -> tuple[Layout, dict[str, tuple[int, ...]]]:
    """What to read from each file, and the shape of every tensor found (from the headers)."""
    from safetensors import SafetensorError, safe_open

    layout: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        entries: list[tuple[str, str]] = []
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    name = engine_name(key, config)
                    if name is None:
                        continue
                    if name in shapes:
                        raise ModelLoadError(f"tensor {key!r} appears in two files", str(file))
                    shapes[name] = tuple(handle.get_slice(key).get_shape())
                    entries.append((key, name))
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"not a readable safetensors file ({exc})", str(file)) from exc
        layout.append((str(file), tuple(entries)))
    return tuple(layout), shapes
