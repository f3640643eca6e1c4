"""LoRA adapters of the base models, requested by name as their own ``model``.

Each adapter belongs to one base model (``base``; its replicas load it). Two sources: the
adapters the settings name (each model's ``engine.lora_adapters``: every tenant may use them;
every replica of that model has their paths), and those added at run time by an operator
(``fairserve adapters add NAME PATH [--tenant T] [--base MODEL]``), kept in Redis (``keys.adapters()``: a HASH of name ->
JSON, at most ``MAX_ADAPTERS``, until removed). One added for a tenant is that tenant's alone:
another tenant asking for it gets the same 404 as for a name that does not exist, so it cannot
learn that it does. A replica loads an adapter on first use (``replicas/torch_engine/lora.py``); one
added at run time travels with its call as its path, which every replica must be able to read
(a shared volume on Kubernetes).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from router.errors import InvalidRequestError, NotFoundError
from router.state import keys
from router.state.scripts import Script, Scripts

MAX_ADAPTERS = keys.MAX_ADAPTERS
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
MODEL_NOT_FOUND = "model_not_found"


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str | None  # its PEFT directory; None: one the settings name (the replicas know it)
    owner: str | None = None  # the tenant that may use it; None: every tenant
    created_s: int = 0
    base: str | None = None  # the base model it adapts; None: the default model


def model_not_found(model: str) -> NotFoundError:
    error = NotFoundError(f"the model {model!r} does not exist or you do not have access to "
                          "it (GET /v1/models lists those you may use)", param="model")
    error.code = MODEL_NOT_FOUND
    return error


class AdapterRegistry:
    """``bases``: each base model's name (the default first) and the adapters its settings
    name; ``reserved``: other names requests give the base models (aliases), which no
    adapter may take."""

    def __init__(self, client: Any, bases: dict[str, tuple[str, ...]],
                 reserved: frozenset[str] = frozenset()) -> None:
        self.client = client
        self.scripts = Scripts(client)
        self.default_base = next(iter(bases), "")
        self.bases = set(bases)
        self.reserved = self.bases | reserved
        self.configured = {name: Adapter(name, None, base=base)
                           for base, names in bases.items() for name in names}

    async def resolve(self, tenant_id: str, model: str) -> Adapter | None:
        """The adapter ``model`` names for this tenant, its ``base`` filled in; None: a base
        model. 404 ``model_not_found`` for a name that is neither, another tenant's adapter,
        or one whose base model the cluster no longer serves."""
        if model in self.bases:
            return None
        adapter = self.configured.get(model)
        if adapter is None and NAME.match(model):
            raw = await self.client.hget(keys.adapters(), model)
            adapter = _decode(raw) if raw is not None else None
        if adapter is None or adapter.owner not in (None, tenant_id):
            raise model_not_found(model)
        if adapter.base is None:
            adapter = replace(adapter, base=self.default_base)
        if adapter.base not in self.bases:
            raise model_not_found(model)
        return adapter

    async def visible(self, tenant_id: str | None) -> list[Adapter]:
        """What a tenant may use (None: every adapter), by name."""
        added = [a for a in (_decode(raw) for raw in
                             (await self.client.hgetall(keys.adapters())).values())
                 if a is not None]
        return sorted([*self.configured.values(),
                       *(a for a in added if tenant_id is None or a.owner in (None, tenant_id))],
                      key=lambda a: a.name)

    async def add(self, adapter: Adapter) -> None:
        if not NAME.match(adapter.name):
            raise InvalidRequestError(f"adapter name {adapter.name!r}: letters, digits and "
                                      "._:/- (at most 128, starting with a letter or digit)",
                                      param="name")
        if adapter.name in self.reserved or adapter.name in self.configured:
            raise InvalidRequestError(f"{adapter.name!r} is a base model, an alias or an adapter "
                                      "the settings name", param="name")
        if adapter.base is not None and self.bases and adapter.base not in self.bases:
            raise InvalidRequestError(f"no base model {adapter.base!r} (the cluster serves "
                                      f"{', '.join(sorted(self.bases))})", param="base")
        if not adapter.path:
            raise InvalidRequestError("an adapter added at run time needs its path",
                                      param="path")
        record = {**asdict(adapter), "created_s": adapter.created_s or int(time.time())}
        reply = await self.scripts.run(Script.ADAPTER_PUT, adapter.name, json.dumps(record))
        if reply[0] == b"full":
            raise InvalidRequestError(f"at most {MAX_ADAPTERS} adapters; remove one first",
                                      param="name")

    async def remove(self, name: str) -> bool:
        return bool(await self.client.hdel(keys.adapters(), name))


def _decode(raw: bytes | str) -> Adapter | None:
    try:
        data = json.loads(raw)
        return Adapter(str(data["name"]), data.get("path"), data.get("owner"),
                       int(data.get("created_s", 0)), data.get("base"))
    except (ValueError, KeyError, TypeError):
        return None
