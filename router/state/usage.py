"""Usage records: what each tenant used, per model (or adapter) and UTC hour.

The scripts that admit and end requests write them as they go (``usage`` in ``_lib.lua``), so
recording costs no round trip of its own: ``fs:{t}:usage:<hour>`` is a hash of
``<model>|<counter>`` kept ``queues.usage_retention_days``. The counters:

- ``requests``: requests that ended (served, cancelled, dead-lettered);
- ``prompt_tokens``, ``cached_tokens`` (of the prompt, found in the prefix cache),
  ``completion_tokens``: what was charged, as the clients' ``usage`` says;
- ``queue_ms`` (admitted to granted) and ``engine_ms`` (arrived at the replica to finished);
- errors by kind: ``failed`` (ended with an error), ``cancelled``, ``dead``;
- ``refused_<reason>``: admissions refused (rpm, tpm, daily_budget, queue_full, streams).
  Refusals made before the admission script (the quota check at authentication, the tenant
  gate) are in the metrics only: recording them would add a round trip to the path built to
  shed load cheaply.

A request is recorded in the hour it ended (a refusal in the hour it was refused).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from router.errors import InvalidRequestError
from router.state import keys

if TYPE_CHECKING:
    import redis.asyncio as aioredis

COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "queue_ms",
            "engine_ms", "failed", "cancelled", "dead")
GROUPS = ("tenant", "model", "hour", "day")
MAX_CELLS = 100_000  # tenants x hours one read may look at (each a hash in Redis)
READ_BATCH = 500  # hashes per pipeline


@dataclass(slots=True)
class UsageRow:
    """The counters of one group (the fields not grouped by are "")."""

    tenant: str = ""
    model: str = ""
    start_ms: int | None = None  # the hour's or day's start; None: not grouped by time
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def refused(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("refused_"))

    def as_dict(self, group_by: Sequence[str]) -> dict[str, object]:
        out: dict[str, object] = {}
        if "tenant" in group_by:
            out["tenant"] = self.tenant
        if "model" in group_by:
            out["model"] = self.model
        if self.start_ms is not None:
            out["start"] = iso(self.start_ms)
        out.update({name: self.counts.get(name, 0) for name in COUNTERS})
        out["refused"] = self.refused
        return out


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def hours_between(since_ms: int, until_ms: int) -> range:
    """The hours (ms // HOUR_MS) that overlap [since, until)."""
    first = since_ms // keys.HOUR_MS
    last = (until_ms - 1) // keys.HOUR_MS
    return range(first, max(last + 1, first))


class UsageReader:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def tenants(self) -> list[str]:
        return sorted(t.decode() for t in await self.client.smembers(keys.tenants()))

    async def read(self, since_ms: int, until_ms: int, tenants: Iterable[str] | None = None,
                   group_by: Sequence[str] = ("tenant", "model", "hour")) -> list[UsageRow]:
        """The records of the hours in [since, until) (whole hours: an hour is in when it
        overlaps), summed by ``group_by`` (of tenant, model, and hour or day). A read over
        more than ``MAX_CELLS`` tenant-hours is refused (it would hold the Redis every
        tenant's requests go through)."""
        for name in group_by:
            if name not in GROUPS:
                raise InvalidRequestError(f"group_by: {name!r} is not one of {', '.join(GROUPS)}",
                                          param="group_by")
        if "hour" in group_by and "day" in group_by:
            raise InvalidRequestError("group_by: hour or day, not both", param="group_by")
        if until_ms <= since_ms:
            raise InvalidRequestError("until must be after since", param="until")
        names = sorted(tenants) if tenants is not None else await self.tenants()
        hours = hours_between(since_ms, until_ms)
        if len(names) * len(hours) > MAX_CELLS:
            raise InvalidRequestError(
                f"{len(names)} tenants x {len(hours)} hours is over {MAX_CELLS} records in one "
                "read: narrow since/until or name the tenants", param="since")
        cells = [(t, h) for t in names for h in hours]
        rows: dict[tuple[str, str, int | None], UsageRow] = {}
        for start in range(0, len(cells), READ_BATCH):
            batch = cells[start:start + READ_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for tenant, hour in batch:
                pipe.hgetall(keys.usage(tenant, hour))
            for (tenant, hour), record in zip(batch, await pipe.execute(), strict=True):
                for raw, value in record.items():
                    model, _, counter = raw.decode().rpartition("|")
                    row = self._row(rows, group_by, tenant, model, hour)
                    row.counts[counter] = row.counts.get(counter, 0) + int(value)
        return sorted(rows.values(), key=lambda r: (r.start_ms or 0, r.tenant, r.model))

    @staticmethod
    def _row(rows: dict[tuple[str, str, int | None], UsageRow], group_by: Sequence[str],
             tenant: str, model: str, hour: int) -> UsageRow:
        start: int | None = None
        if "hour" in group_by:
            start = hour * keys.HOUR_MS
        elif "day" in group_by:
            start = hour * keys.HOUR_MS // 86_400_000 * 86_400_000
        group = (tenant if "tenant" in group_by else "", model if "model" in group_by else "",
                 start)
        row = rows.get(group)
        if row is None:
            row = rows[group] = UsageRow(group[0], group[1], start)
        return row


def render(rows: list[UsageRow], group_by: Sequence[str], fmt: str) -> str:
    """``table``, ``csv`` or ``json`` (a list of objects)."""
    return render_dicts([r.as_dict(group_by) for r in rows], group_by, fmt)


def render_dicts(dicts: list[dict[str, object]], group_by: Sequence[str], fmt: str) -> str:
    """Rows as ``UsageRow.as_dict`` (or the admin API) gives them, as ``render`` writes them."""
    if fmt == "json":
        return json.dumps(dicts, indent=2)
    columns = list(dicts[0]) if dicts else [*group_by, *COUNTERS, "refused"]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(dicts)
        return out.getvalue()
    widths = {c: max([len(c), *(len(str(d[c])) for d in dicts)]) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(d[c]).ljust(widths[c]) for c in columns) for d in dicts]
    return "\n".join(lines) + "\n"
