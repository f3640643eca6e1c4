"""``LocalPath``: the settings type of every file or directory a fairserve process reads.

NOTE: a path in the settings travels. ``redis-server`` changes into its ``--dir`` before it opens
its ``--logfile``; Ray workers run in directories of Ray's choosing; ``fairserve down`` may run
from another shell. A relative path means something else in each of them, so every path field
is made absolute (``~`` expanded) once, where the settings are read, and everything after that
sees only absolute paths:

- a value from a settings YAML file is relative to that file's directory (as docker-compose and
  kustomize read theirs), so ``--config ../fairserve.yaml`` means the same from any directory;
- a value from a flag, an environment variable or code is relative to the current directory.

The YAML side is done by ``resolve_yaml_paths``, which finds the fields by this type's marker,
so a new path field only has to be declared a ``LocalPath``.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel

P = TypeVar("P", str, Path, None)


def absolute_path(value: P, base: str | Path | None = None) -> P:
    """``value`` with ``~`` expanded, made absolute against ``base`` (default: the current
    directory). ``None`` and ``""`` (the settings' "none") are returned as they are."""
    if value is None or value == "":
        return value
    expanded = os.path.expanduser(os.fspath(value))
    joined = os.path.join(os.fspath(base), expanded) if base is not None else expanded
    resolved = os.path.abspath(joined)
    return Path(resolved) if isinstance(value, Path) else resolved  # type: ignore[return-value]


class _LocalPathMarker:
    """Marks a settings field as a local path (found by ``resolve_yaml_paths``)."""


LOCAL_PATH = _LocalPathMarker()
LocalPath = Annotated[Path, AfterValidator(absolute_path), LOCAL_PATH]
LocalPathStr = Annotated[str, AfterValidator(absolute_path), LOCAL_PATH]


def resolve_yaml_paths(model: type[BaseModel], data: Any, base: Path) -> Any:
    """``data`` (a YAML document for ``model``) with its relative local paths made absolute
    against ``base``; everything else is left to the model's validation."""
    if not isinstance(data, dict):
        return data
    resolved = dict(data)
    for name, field in model.model_fields.items():
        if name not in resolved:
            continue
        if _is_local_path(field.metadata, field.annotation) and isinstance(resolved[name], str):
            resolved[name] = absolute_path(resolved[name], base)
            continue
        branch = _model_of(field.annotation)
        if branch is not None:
            resolved[name] = resolve_yaml_paths(branch, resolved[name], base)
    return resolved


def _is_local_path(metadata: list[Any], annotation: Any) -> bool:
    """``LocalPath``, or ``LocalPath | None`` (whose marker sits inside the union)."""
    if LOCAL_PATH in metadata:
        return True
    return any(LOCAL_PATH in getattr(arg, "__metadata__", ())
               for arg in typing.get_args(annotation))


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The settings branch a field holds (``Branch`` or ``Branch | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        models = [a for a in typing.get_args(annotation)
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None
