"""LoRA adapters on the torch engine: PEFT checkpoints, kept in a bounded LRU, applied per row.

An adapter adds a low-rank update to some of the model's linear layers: ``y = x W^T +
s (x A^T) B^T`` with ``A`` (r, in), ``B`` (out, r) and ``s = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``). It comes in PEFT's format: ``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.model.layers.<i>.<module>.lora_A.weight``
and ``lora_B.weight``. The model fuses q/k/v and gate/up into one projection each, so an
update of ``q_proj`` lands on the rows of ``qkv_proj`` that are q's (``_FUSED``).

One engine step mixes requests of several adapters and of the base model: the base projection
runs once for every row, then the adapters' updates are added to their rows by grouped matmuls
(S-LoRA's and Punica's idea, in torch ops): the rows are cut into tiles of one adapter each,
every tile's input is gathered at once, batched matmuls (``bmm``) apply each tile's own ``A``
(for a fused projection, its modules' ``A`` side by side: one matmul) and each module's ``B``,
and one scatter-add per module puts the results back. Per projection that is a handful of ops
whatever the number of adapters in the step. The step's adapters of one rank are stacked once
per set of adapters and kept while the set lasts (``LoraStacks``).

NOTE: batch invariance. A request's text must not depend on who shares its step (a migrated
request resumes to the text it would have had). A matmul's last bits depend on its shape (the
kernel and blocking are chosen by it; see models/cpu_linear.py), so the update is computed in
float32 in tiles of exactly ``ROW_TILE`` rows of one adapter (padded with zeros), and adapters
are stacked only with adapters of their own rank, each fused projection always with all its
modules (zeros for those an adapter leaves alone): a row meets the same matmul shapes whatever
else the step holds. The update is added in the projection's dtype.

On a CPU with fairserve's kernels (``kernels/cpu_ops.cpp``, ``lora_apply``) each projection's
update is one call instead, for the step's adapters of every rank: row by row, grouped by
adapter (an adapter's weights are read once for its rows), float32 arithmetic on a copy of
each adapter's weights in the model's dtype made on first use (``LoraAdapter.kernel_weights``:
a decode step is bound by the bytes it reads, and an int4 model's own are fewer than eight
adapters' in float32), each row by the same loops from its own inputs, so batch invariant by
construction (Punica's SGMV on a CPU). The torch ops above are the path where the
kernels are not built, and on a GPU.

NOTE: slots. ``AdapterCache`` keeps at most ``max_loras`` adapters loaded, least recently used
out first. A request holds a reference to its adapter's weights, so evicting one that running
requests use only drops it from the cache: they finish with it, and the next request of it
loads it again. What is resident is thus at most ``max_loras`` plus the adapters of running
requests (at most ``max_num_seqs``); an adapter of the 135M default model at rank 8 on every
projection is about 10 MB in float32 (``num_bytes``), and the stacks of the step's adapters
(``LoraStacks``, the last two sets) hold copies of as many again.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from replicas.engine.lora_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    parse_key,
    read_config,
)
from replicas.torch_engine.models.model_config import ModelConfig

ROW_TILE = 16


@dataclass(frozen=True, slots=True)
class LoraUpdate:
    """One adapter's update of one projection's rows ``[start, end)``."""

    start: int
    end: int
    a: torch.Tensor  # (r, in) float32
    b: torch.Tensor  # (end - start, r) float32, the scale folded in

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True)
class LoraAdapter:
    name: str
    rank: int
    # per layer: projection -> its updates
    layers: list[dict[str, list[LoraUpdate]]]
    # projection -> the rows of each of its modules, in order (q, k, v; gate, up)
    modules: dict[str, tuple[tuple[int, int], ...]]
    in_features: dict[str, int]  # projection -> its input width
    num_bytes: int = 0
    load_s: float = 0.0
    # (layer, projection, dtype) -> its weights as the CPU kernel reads them (kernel_weights)
    _kernel: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False)

    def kernel_weights(self, layer: int, projection: str, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A (M r, in: the projection's M modules one under the other, zeros where this
        adapter leaves a module alone) and B (r, out) in ``dtype``, made on first use; two
        empty tensors where it leaves the whole projection alone."""
        key = (layer, projection, dtype)
        weights = self._kernel.get(key)
        if weights is None:
            updates = self.layers[layer].get(projection, ())
            if not updates:
                weights = (torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype))
            else:
                rows = self.modules[projection]
                starts = [start for start, _ in rows]
                a = torch.zeros(len(rows) * self.rank, self.in_features[projection])
                b = torch.zeros(self.rank, rows[-1][1])
                for u in updates:
                    j = starts.index(u.start)
                    a[j * self.rank:(j + 1) * self.rank] = u.a
                    b[:, u.start:u.end] = u.b.T
                weights = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
            self._kernel[key] = weights
        return weights


def _fused(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Hugging Face module -> (projection, first row, end row)."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, q + kv),
            "v_proj": ("qkv", q + kv, q + 2 * kv), "o_proj": ("o", 0, cfg.hidden_size),
            "gate_proj": ("gate_up", 0, inter), "up_proj": ("gate_up", inter, 2 * inter),
            "down_proj": ("down", 0, cfg.hidden_size)}


def _in_features(cfg: ModelConfig, module: str) -> int:
    if module == "o_proj":
        return cfg.num_heads * cfg.head_dim
    if module == "down_proj":
        return cfg.intermediate_size
    return cfg.hidden_size


def load_adapter(path: Path, cfg: ModelConfig, name: str) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory for ``cfg``'s model; ``AdapterError`` names what
    does not fit."""
    started = time.perf_counter()
    rank, scale = read_config(path / CONFIG_FILE, name)
    pairs = _read_weights(path / WEIGHTS_FILE, cfg, name)
    fused = _fused(cfg)
    layers: list[dict[str, list[LoraUpdate]]] = [{} for _ in range(cfg.num_layers)]
    num_bytes = 0
    for (layer, module), ab in sorted(pairs.items()):
        projection, start, end = fused[module]
        a, b = ab.get("A"), ab.get("B")
        expected_a, expected_b = (rank, _in_features(cfg, module)), (end - start, rank)
        if a is None or b is None or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise AdapterError(
                f"adapter {name!r}: {path / WEIGHTS_FILE}: layer {layer} {module}: lora_A "
                f"{None if a is None else tuple(a.shape)} and lora_B "
                f"{None if b is None else tuple(b.shape)}, expected {expected_a} and {expected_b}")
        update = LoraUpdate(start, end, a.float().contiguous(),
                            (b.float() * scale).contiguous())
        layers[layer].setdefault(projection, []).append(update)
        num_bytes += 4 * (update.a.numel() + update.b.numel())
    modules: dict[str, tuple[tuple[int, int], ...]] = {}
    in_features: dict[str, int] = {}
    for module, (projection, start, end) in fused.items():
        modules[projection] = (*modules.get(projection, ()), (start, end))
        in_features[projection] = _in_features(cfg, module)
    return LoraAdapter(name, rank, layers, modules, in_features, num_bytes,
                       time.perf_counter() - started)


def _read_weights(weights_file: Path, cfg: ModelConfig, name: str
                  ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": lora_A, "B": lora_B}, from ``adapter_model.safetensors``."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {weights_file}: {exc}") from exc
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, side = parse_key(key, weights_file, name)
        if layer >= cfg.num_layers:
            raise AdapterError(f"adapter {name!r}: {weights_file}: {key!r} names layer {layer}; "
                               f"the model has {cfg.num_layers}")
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    return pairs


# A (S, in, M r), B (S, r, out: the modules' B side by side, as their rows tile the output),
# the modules' first columns and the end (M + 1)
_Stack = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class LoraStacks:
    """Adapters of one rank stacked, per layer and projection: ``A`` (S, in, M r: the M
    modules' A side by side) and each module's ``B`` (S, r, rows); None where none of them
    updates the projection. Built on first use, kept for the last ``max_sets`` sets of
    adapters (a set lasts as long as the same requests run together)."""

    def __init__(self, max_sets: int = 2) -> None:
        self.max_sets = max_sets
        self._sets: OrderedDict[tuple[int, ...], dict[tuple[int, str], _Stack]] = OrderedDict()

    def of(self, adapters: tuple[LoraAdapter, ...]) -> dict[tuple[int, str], _Stack]:
        key = tuple(id(a) for a in adapters)
        stacked = self._sets.get(key)
        if stacked is None:
            stacked = self._sets[key] = {}
            while len(self._sets) > self.max_sets:
                self._sets.popitem(last=False)
        self._sets.move_to_end(key)
        return stacked

    @staticmethod
    def stack(adapters: tuple[LoraAdapter, ...], layer: int, projection: str) -> _Stack:
        if not any(a.layers[layer].get(projection) for a in adapters):
            return None
        first = adapters[0]
        rank, rows = first.rank, first.modules[projection]
        a = torch.zeros(len(adapters), first.in_features[projection], len(rows) * rank)
        b = torch.zeros(len(adapters), rank, rows[-1][1])
        starts = [start for start, _ in rows]
        assert starts[0] == 0 and all(e == s for (_, e), s in zip(rows, starts[1:], strict=False))
        for i, adapter in enumerate(adapters):
            for u in adapter.layers[layer].get(projection, ()):
                j = starts.index(u.start)
                a[i, :, j * rank:(j + 1) * rank] = u.a.T
                b[i, :, u.start:u.end] = u.b.T
        return a, b, torch.tensor([*starts, rows[-1][1]], dtype=torch.long)


@dataclass(slots=True)
class _RankGroup:
    """The step's adapters of one rank, and their rows as tiles of ``ROW_TILE``."""

    adapters: tuple[LoraAdapter, ...]
    tile_rows: torch.Tensor  # (tiles * ROW_TILE,) the rows of each tile; padding: num_rows
    tile_adapters: torch.Tensor  # (tiles,) each tile's adapter (index into adapters)
    real: torch.Tensor  # positions in tile_rows that hold real rows
    rows: torch.Tensor  # those rows
    is_one_tile_each: bool  # tile i is adapter i's only one: the stacks need no gather
    stacked: dict[tuple[int, str], _Stack]

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        key = (layer, projection)
        if key not in self.stacked:
            self.stacked[key] = LoraStacks.stack(self.adapters, layer, projection)
        weights = self.stacked[key]
        if weights is None:
            return
        a, b, starts = weights
        if not self.is_one_tile_each:
            a = a.index_select(0, self.tile_adapters)
            b = b.index_select(0, self.tile_adapters)
        bounds = starts.tolist()
        bs = [b[:, :, c0:c1] for c0, c1 in zip(bounds, bounds[1:], strict=False)]
        x_padded = F.pad(x, (0, 0, 0, 1))  # the padding rows read this zero row
        tiles = x_padded.index_select(0, self.tile_rows).float().view(a.shape[0], ROW_TILE, -1)
        h = torch.bmm(tiles, a)  # (tiles, ROW_TILE, M r)
        rank = self.adapters[0].rank
        # the modules' rows tile the projection's output in order: one scatter-add for all
        parts = [torch.bmm(h[:, :, j * rank:(j + 1) * rank], b) for j, b in enumerate(bs)]
        delta = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).view(-1, y.shape[1])
        y.index_add_(0, self.rows, delta.index_select(0, self.real).to(y.dtype))


@dataclass(slots=True)
class _KernelGroup:
    """The step's adapters, any rank, for the CPU kernel: their rows, grouped by adapter,
    and each row's adapter."""

    adapters: tuple[LoraAdapter, ...]
    rows: torch.Tensor
    slots: torch.Tensor  # each row's adapter (index into adapters)
    starts: dict[str, torch.Tensor] = field(default_factory=dict)  # projection -> columns

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        starts = self.starts.get(projection)
        if starts is None:
            modules = self.adapters[0].modules[projection]
            starts = self.starts[projection] = torch.tensor(
                [start for start, _ in modules] + [modules[-1][1]], dtype=torch.long)
        weights = [a.kernel_weights(layer, projection, x.dtype) for a in self.adapters]
        torch.ops.fairserve.lora_apply(y, x.contiguous(), self.rows, self.slots,
                                       [w[0] for w in weights], [w[1] for w in weights], starts)


@dataclass(slots=True)
class LoraBatch:
    """Which rows of a step use which adapter (rows of the base model are in no group)."""

    groups: list[_RankGroup] | list[_KernelGroup]

    @classmethod
    def of_rows(cls, adapters: list[LoraAdapter | None], device: torch.device,
                stacks: LoraStacks | None = None, use_kernel: bool | None = None
                ) -> LoraBatch | None:
        """From each row's adapter (None: the base model); None when no row has one.
        ``use_kernel``: the CPU kernel's path (None: where it is loaded, on a CPU)."""
        if use_kernel is None:
            use_kernel = device.type == "cpu" and has_kernel()
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(row)
        if not rows:
            return None
        if use_kernel:
            members = list(rows.values())
            return cls([_KernelGroup(
                tuple(adapter for adapter, _ in members),
                torch.tensor([r for _, indices in members for r in indices], dtype=torch.long),
                torch.tensor([i for i, (_, indices) in enumerate(members) for _ in indices],
                             dtype=torch.long))])
        stacks = stacks or LoraStacks()
        by_rank: dict[int, list[tuple[LoraAdapter, list[int]]]] = {}
        for adapter, indices in rows.values():
            by_rank.setdefault(adapter.rank, []).append((adapter, indices))
        return cls([_group(members, len(adapters), device, stacks)
                    for members in by_rank.values()])

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor
              ) -> torch.Tensor:
        """Add the adapters' updates of ``projection`` in ``layer`` to their rows of ``y``
        (the base projection of ``x``), in place; returns ``y``."""
        for group in self.groups:
            group.apply(layer, projection, x, y)
        return y


def has_kernel() -> bool:
    """Whether fairserve's CPU kernels, with ``lora_apply``, are loaded in this process."""
    return hasattr(torch.ops.fairserve, "lora_apply")


def _group(members: list[tuple[LoraAdapter, list[int]]], pad: int, device: torch.device,
           stacks: LoraStacks) -> _RankGroup:
    tile_rows: list[int] = []
    tile_adapters: list[int] = []
    for index, (_, indices) in enumerate(members):
        for start in range(0, len(indices), ROW_TILE):
            tile = indices[start:start + ROW_TILE]
            tile_rows += tile + [pad] * (ROW_TILE - len(tile))
            tile_adapters.append(index)
    real = [i for i, row in enumerate(tile_rows) if row != pad]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    adapters = tuple(adapter for adapter, _ in members)
    return _RankGroup(adapters, tensor(tile_rows), tensor(tile_adapters), tensor(real),
                      tensor([tile_rows[i] for i in real]),
                      tile_adapters == list(range(len(members))), stacks.of(adapters))


class AdapterCache:
    """The adapters a replica has loaded: at most ``max_loras``, least recently used out first
    (see the NOTE on slots); ``get`` loads on demand."""

    def __init__(self, paths: Mapping[str, Path], cfg: ModelConfig, max_loras: int,
                 load: Callable[[Path, ModelConfig, str], LoraAdapter] = load_adapter) -> None:
        self.paths = dict(paths)
        self.cfg = cfg
        self.max_loras = max_loras
        self._load = load
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.num_loads = 0

    def register(self, name: str, path: Path) -> None:
        """Add (or repoint) an adapter at run time; a repointed one is loaded again."""
        self.paths[name] = path
        self._loaded.pop(name, None)

    def get(self, name: str) -> LoraAdapter:
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            return adapter
        path = self.paths.get(name)
        if path is None:
            raise AdapterError(f"no adapter {name!r} on this replica")
        adapter = self._load(path, self.cfg, name)
        self.num_loads += 1
        self._loaded[name] = adapter
        while len(self._loaded) > self.max_loras:
            self._loaded.popitem(last=False)
        return adapter

    @property
    def loaded(self) -> list[str]:
        """Names, least recently used first."""
        return list(self._loaded)


MODULE_PARTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(directory: Path, cfg: ModelConfig, rank: int, seed: int,
                         modules: tuple[str, ...] = tuple(MODULE_PARTS), std: float = 0.05
                         ) -> Path:
    """A LoRA adapter of ``cfg``'s model with random weights, in PEFT's format, for tests and
    benchmarks (nothing is downloaded). B is random, not zero as PEFT initialises it, so that
    the adapter changes the output."""
    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv),
              "v_proj": (cfg.hidden_size, kv), "o_proj": (q, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in modules:
            in_features, out_features = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{MODULE_PARTS[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features,
                                                          generator=generator) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank,
                                                          generator=generator) * std
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(modules), "bias": "none", "fan_in_fan_out": False,
        "lora_dropout": 0.0}))
    return directory
