"""A GGUF model's prepared form, kept on disk so later loads skip the GGUF file.

Reading SmolLM2's GGUF costs about 6 s of CPU before the first weight is copied: the metadata
parse (the vocabulary is a 49k-entry array read element by element), the tokenizer rebuilt
from it, and the dequantization. A replica that starts because a backlog is rising cannot
afford that, so the first load writes what it produced under ``cache_dir``:

    <cache_dir>/<file stem>-<key>/
        fairserve-model.json   the ModelConfig, the source file's identity, the format version
        model.safetensors      the weights, dequantized, un-permuted, in the engine's names
        tokenizer/             the tokenizer's files (``save_pretrained``), chat template too

and every later load of the same file (same absolute path, size and mtime, same dtype) reads
that instead: safetensors are memory-mapped, the tokenizer loads from its JSON. The key hashes
all of these plus ``FORMAT_VERSION``, so an edited file or a new format misses rather than
loads stale data. A directory is written under a temporary name and renamed into place, so a
reader never sees a partial one, and two replicas preparing the same model at once both
succeed (the second rename loses and is discarded); staging left by a build that was killed
is removed by a later build once an hour old. A cache that cannot be written (read-only or full
disk) only costs the speed; one that cannot be read is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from replicas.engine.errors import ModelLoadError
from replicas.engine.tokenizer import Tokenizer
from replicas.torch_engine.loader.gguf_loader import open_gguf
from replicas.torch_engine.loader.hf_loader import HFCheckpoint, safetensors_layout
from replicas.torch_engine.loader.weight_names import check_weight_shapes
from replicas.torch_engine.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "fairserve-model.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"
ABANDONED_AFTER_S = 3600.0  # a staging directory this old belongs to no live build
_OPEN_ERRORS = (ModelLoadError, OSError, ValueError, KeyError, TypeError)


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    """A model ready to load: its config, a fresh pass over its weights, its tokenizer.

    ``directory`` is the prepared copy the weights are read from; None when none could be
    written and they stream from the GGUF file itself.
    """

    config: ModelConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Tokenizer
    directory: Path | None


def prepared_dir(path: str, dtype: torch.dtype, cache_dir: str) -> Path:
    """Where the prepared form of the GGUF file ``path`` in ``dtype`` lives."""
    source = Path(path).resolve()
    stat = source.stat()
    identity = f"{FORMAT_VERSION}|{source}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{source.stem}-{key}"


def load_prepared(path: str, dtype: torch.dtype, cache_dir: str) -> PreparedModel:
    """The prepared form of ``path``, read from ``cache_dir`` or built there first.

    Raises ModelLoadError (naming ``path``) only for a GGUF file that cannot be loaded at all.
    """
    directory = prepared_dir(path, dtype, cache_dir)
    if directory.is_dir():
        try:
            return _open(directory, dtype)
        except _OPEN_ERRORS as exc:
            logger.warning("prepared model %s is unreadable (%s); rebuilding it", directory, exc)
            shutil.rmtree(directory, ignore_errors=True)
    return _build(path, dtype, directory)


def _open(directory: Path, dtype: torch.dtype) -> PreparedModel:
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format version {manifest.get('format_version')!r}")
    if manifest.get("dtype") != str(dtype):
        raise ValueError(f"weights in {manifest.get('dtype')!r}, not {dtype}")
    fields = dict(manifest["config"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    config = ModelConfig(**fields)
    weights = directory / WEIGHTS_FILE
    layout, shapes = safetensors_layout([weights], config)
    check_weight_shapes(shapes, config, str(weights))
    tokenizer = Tokenizer.from_hf_dir(str(directory / TOKENIZER_DIR), config.eos_token_ids)
    checkpoint = HFCheckpoint(str(directory), config, layout)
    return PreparedModel(config, partial(checkpoint.weights, dtype), tokenizer, directory)


def _build(path: str, dtype: torch.dtype, directory: Path) -> PreparedModel:
    """Read the GGUF file once, write its prepared form, and open that."""
    gguf = open_gguf(path)
    tokenizer = Tokenizer.from_gguf(path, gguf.config.architecture, gguf.config.eos_token_ids)
    staging = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.tmp")
    _remove_abandoned(directory.parent)
    try:
        _write(staging, path, dtype, gguf.config, dict(gguf.weights(dtype)), tokenizer)
        try:
            staging.rename(directory)
        except OSError:  # another process prepared it first: use theirs
            if not directory.is_dir():
                raise
        prepared = _open(directory, dtype)
        logger.info("prepared %s in %s", path, directory)
        return prepared
    except _OPEN_ERRORS as exc:
        logger.warning("cannot keep a prepared copy of %s in %s (%s); it loads from the GGUF "
                       "file every time", path, directory.parent, exc)
        return PreparedModel(gguf.config, partial(gguf.weights, dtype), tokenizer, None)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_abandoned(cache_dir: Path) -> None:
    """Staging directories of builds that died (killed mid-write) an hour ago or more."""
    cutoff = time.time() - ABANDONED_AFTER_S
    for stale in cache_dir.glob(".*.tmp"):
        try:
            if stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            continue


def _write(staging: Path, path: str, dtype: torch.dtype, config: ModelConfig,
           weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    from safetensors.torch import save_file

    staging.mkdir(parents=True)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()},
              str(staging / WEIGHTS_FILE))
    tokenizer.hf_tokenizer.save_pretrained(str(staging / TOKENIZER_DIR))
    stat = Path(path).resolve().stat()
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "source": {"path": str(Path(path).resolve()), "size": stat.st_size,
                   "mtime_ns": stat.st_mtime_ns},
        "dtype": str(dtype),
        "config": dataclasses.asdict(config),
    }
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
