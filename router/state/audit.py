"""The audit log: every administrative change, who made it, and what it changed.

One Redis stream, ``fs:audit`` (owner: whoever administers tenants; the CLI, a tenants file's
load at start). Each entry: the time (its stream id), the actor (``cli:<user>``,
``file:<path>``), the action (``tenant.create``, ``tenant.update``, ``tenant.disable``,
``key.create``, ``key.revoke``, ``adapter.add``, ``adapter.remove``), the target, and the state
before and after as JSON. Keys appear as their id, label and a prefix of their digest, never a
secret. Append-only: nothing rewrites an entry; each write trims the stream to
``max_entries`` (``MAXLEN``) and drops entries older than ``retention_days`` (``MINID``), so
the age bound holds from the next write on (with no writes at all, old entries stay: at most
``max_entries``).

Where an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_LOGS_ENDPOINT``), each entry is also an OpenTelemetry log record.

NOTE: an entry is written after its change, not in the same script: a Redis failure between
the two leaves a change unrecorded (the change itself is never lost or doubled).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.state import keys

if TYPE_CHECKING:
    import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

RETENTION_DAYS = 365
MAX_ENTRIES = 100_000
MAX_READ = 10_000  # entries one read returns


def cli_actor() -> str:
    """The actor of a change made with the CLI: the operating-system user."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return f"cli:uid-{os.getuid()}"


def change_action(changes: Mapping[str, Any]) -> str:
    """The audit action of a change of a tenant's settings: ``tenant.disable`` or
    ``tenant.enable`` when that is all it changes, else ``tenant.update``."""
    if set(changes) == {"disabled"}:
        return "tenant.disable" if changes["disabled"] else "tenant.enable"
    return "tenant.update"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: str  # the stream id: <ms>-<seq>
    time_ms: int
    actor: str
    action: str
    target: str
    before: Any
    after: Any

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "time_ms": self.time_ms, "actor": self.actor,
                "action": self.action, "target": self.target, "before": self.before,
                "after": self.after}


class AuditLog:
    def __init__(self, client: aioredis.Redis, retention_days: int = RETENTION_DAYS,
                 max_entries: int = MAX_ENTRIES, env: Mapping[str, str] = os.environ,
                 log_exporter: Any = None) -> None:
        """``log_exporter``: an OpenTelemetry log exporter to use instead of the OTLP one the
        environment names."""
        self.client = client
        self.retention_days = retention_days
        self.max_entries = max_entries
        self._otel = _otel_logger(env, log_exporter)

    async def record(self, actor: str, action: str, target: str, before: Any = None,
                     after: Any = None) -> str:
        fields = {"actor": actor, "action": action, "target": target,
                  "before": json.dumps(before), "after": json.dumps(after)}
        oldest = int(time.time() * 1000) - self.retention_days * 86_400_000
        pipe = self.client.pipeline(transaction=False)
        # exact trims: administrative changes are rare, and their bounds then hold exactly
        pipe.xadd(keys.audit(), fields, maxlen=self.max_entries, approximate=False)
        pipe.xtrim(keys.audit(), minid=f"{oldest}-0", approximate=False)
        entry_id, _ = await pipe.execute()
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        if self._otel is not None:
            self._otel.emit(fields, entry_id)
        return entry_id

    async def read(self, since_ms: int = 0, until_ms: int | None = None,
                   count: int = 1_000) -> list[AuditEntry]:
        """Entries from ``since_ms`` up to ``until_ms`` (now), oldest first, at most
        ``count`` (``MAX_READ``)."""
        end = "+" if until_ms is None else str(until_ms)
        raw = await self.client.xrange(keys.audit(), min=str(since_ms), max=end,
                                       count=min(count, MAX_READ))
        return [_entry(i, f) for i, f in raw]


def _entry(raw_id: bytes, fields: dict[bytes, bytes]) -> AuditEntry:
    entry_id = raw_id.decode()
    text = {k.decode(): v.decode() for k, v in fields.items()}
    return AuditEntry(entry_id, int(entry_id.split("-")[0]), text.get("actor", ""),
                      text.get("action", ""), text.get("target", ""),
                      json.loads(text.get("before", "null")), json.loads(text.get("after", "null")))


class _OtelAudit:
    """Audit entries as OpenTelemetry log records (``fairserve.audit``)."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.logger = provider.get_logger("fairserve.audit")

    def emit(self, fields: dict[str, str], entry_id: str) -> None:
        from opentelemetry._logs import LogRecord, SeverityNumber

        self.logger.emit(LogRecord(
            timestamp=time.time_ns(), severity_number=SeverityNumber.INFO, severity_text="INFO",
            body=f"{fields['actor']} {fields['action']} {fields['target']}",
            attributes={f"fairserve.audit.{k}": v for k, v in fields.items()}
            | {"fairserve.audit.id": entry_id}))

    def flush(self) -> None:
        self.provider.force_flush()


def _otel_logger(env: Mapping[str, str], exporter: Any) -> _OtelAudit | None:
    """Log records go out in the background (a batch processor: a slow collector never holds
    an administrative change), flushed at exit."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource

    if exporter is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return None
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

        if not env.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"):
            endpoint = endpoint.rstrip("/") + "/v1/logs"
        exporter = OTLPLogExporter(endpoint)
    provider = LoggerProvider(resource=Resource.create(
        {"service.name": env.get("OTEL_SERVICE_NAME") or "fairserve"}))
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    return _OtelAudit(provider)
