"""Every Redis key fairserve uses, built from the templates in this one module.

Layout (prefix ``fs``):

- per tenant, under the hash tag ``{<tenant>}`` so that a tenant's keys share one slot:
  ``fs:{t}:tenant`` (HASH, the tenant's settings), ``fs:{t}:keys`` (HASH key id -> digest),
  ``fs:{t}:state`` (HASH: fair-share finish tag, GCRA theoretical arrival times, the open
  readers of each kind),
  ``fs:{t}:queue`` (LIST of request ids, head = next), ``fs:{t}:req:<id>`` (HASH, one request),
  ``fs:{t}:stream:<id>`` (STREAM, one request's response events), ``fs:{t}:resp:<id>``
  (STRING, a stored Responses API response and its conversation) and ``fs:{t}:resps`` (ZSET,
  their index; ``router/state/responses.py``), ``fs:{t}:idem:<id>``
  (STRING, the body digest of a request sent with an Idempotency-Key), ``fs:{t}:budget:<day>``
  (STRING, tokens reserved or charged on one UTC day), ``fs:{t}:dead`` (ZSET of dead-lettered
  ids), ``fs:{t}:stats`` (HASH of counters);
- global: ``fs:tenants`` (SET of tenant ids), ``fs:tenants:file`` (HASH tenant id -> what the
  tenants file last applied to it: its settings and key ids, JSON; one entry per tenant the file
  owns, kept while it owns it), ``fs:apikey:<digest>`` (HASH, one API key, found
  by the SHA-256 digest of the key), and the scheduler under the hash tag ``{sched}``:
  ``fs:{sched}:classes`` (ZSET of priority classes with backlog), ``fs:{sched}:ready:<class>``
  (ZSET tenant -> start tag of its head request), ``fs:{sched}:vtime`` (HASH class -> virtual
  time), ``fs:{sched}:leases`` (ZSET ``"<tenant> <id>"`` -> lease deadline in ms),
  ``fs:{sched}:detached`` (ZSET ``"<tenant> <id>"`` -> when a request nobody reads is cancelled),
  ``fs:{sched}:readers`` (ZSET ``"<tenant> <id> <reader> <kind>"`` -> when the lease of a client
  reading a request's stream runs out unless its router renews it; ``router/state/readers.py``),
  ``fs:{sched}:pools`` (SET of the pools other than the default with backlog or leases: at most
  one per model the settings serve, dropped by the reaper once empty),
  ``fs:{sched}:replicas`` (ZSET replica id -> time of its last load report in ms),
  ``fs:{sched}:replica:<id>`` (STRING, the replica's last load report as JSON, with a TTL), and
  the pub/sub channel ``fs:{sched}:wake`` (admissions wake the dispatchers).

Pools: each model the settings serve has its own queues (``router/state/scripts/_lib.lua``):
the default model's pool is ``""`` and its keys are the ones above; another model's queue,
ready sets, classes, leases and virtual times are those keys with ``:<pool>`` appended (the
``state`` fields ``vfinish``, ``vclass`` and ``queued_cost`` likewise), so one model's backlog
neither delays nor scales another's.

NOTE: router/state/scripts.py writes these templates (``%s`` placeholders) and the TTLs below into
the source of every Lua script as constants (``K``, and ``KP``: each template split at its
placeholders), and the scripts build keys by concatenating those parts, so the names live here
only. The grant script crosses
tenants by design (it picks among all of them), so fairserve needs a single Redis primary
(with replicas or Sentinel for failover); the per-tenant hash tags keep the per-tenant data of
one tenant in one slot for a future sharded layout, but Redis Cluster is not supported today.
"""

from __future__ import annotations

import re

from router.errors import InvalidRequestError

PREFIX = "fs"

# Tenant ids and request ids go inside key names: no braces, colons or spaces, so a caller can
# never break out of its own hash tag or forge another tenant's key.
TENANT_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RESPONSE_ID_PATTERN = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")  # POST /v1/responses' ids
POOL_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a model's queues: keys.queue

# TTLs (seconds) of keys that outlive their request, and other named limits.
STREAM_IDLE_TTL_S = 3600  # a response stream with no new event expires after this
# An ended request's record and its stream stay readable (resume, Idempotency-Key replay) this
# long, together: the default of queues.resume_window_s. Past it only the digest of an
# Idempotency-Key's body is kept, IDEMPOTENCY_TTL_S from admission, so a late retry is told so
# (409) and never runs twice: ~0.1 KB per request instead of its record.
RESUME_WINDOW_S = 15 * 60
IDEMPOTENCY_TTL_S = 24 * 3600
BUDGET_DAY_TTL_S = 2 * 24 * 3600  # one day's budget counter, kept past the day for inspection
DEAD_LETTER_TTL_S = 7 * 24 * 3600  # the dead-letter set of a tenant, refreshed on every entry
REPLICA_REPORT_TTL_S = 5  # a load report not refreshed for this long is of a dead replica
READER_LEASE_S = 30  # a reader whose router stopped renewing it (a crash) is let go after this
READER_RETRY_MS = 1_000  # Retry-After of a request refused for its tenant's open readers
# Clients reading one request at once (its first, Idempotency-Key retries, GET resumes): each
# token a request makes is written to every one of them, so without a cap one tenant's request
# could take a router's CPU many times over (a retry and a resume or two is what a client needs)
MAX_READERS_PER_REQUEST = 8
MAX_ADAPTERS = 10_000  # LoRA adapters registered at run time (fs:adapters)
USAGE_RETENTION_DAYS = 35  # usage records (fs:{t}:usage:<hour>): queues.usage_retention_days
HOUR_MS = 3_600_000
STREAM_MAX_EVENTS = 100_000  # approximate cap (XADD MAXLEN ~) on one request's stream

_TEMPLATES: dict[str, str] = {
    "tenant": PREFIX + ":{%s}:tenant",
    "api_keys": PREFIX + ":{%s}:keys",
    "state": PREFIX + ":{%s}:state",
    "queue": PREFIX + ":{%s}:queue",
    "request": PREFIX + ":{%s}:req:%s",
    "stream": PREFIX + ":{%s}:stream:%s",
    "idempotency": PREFIX + ":{%s}:idem:%s",
    "budget": PREFIX + ":{%s}:budget:%s",
    "dead": PREFIX + ":{%s}:dead",
    "stats": PREFIX + ":{%s}:stats",
    "tenants": PREFIX + ":tenants",
    "file_tenants": PREFIX + ":tenants:file",
    "api_key": PREFIX + ":apikey:%s",
    "classes": PREFIX + ":{sched}:classes",
    "ready": PREFIX + ":{sched}:ready:%s",
    "vtime": PREFIX + ":{sched}:vtime",
    "leases": PREFIX + ":{sched}:leases",
    "detached": PREFIX + ":{sched}:detached",
    "readers": PREFIX + ":{sched}:readers",
    "replicas": PREFIX + ":{sched}:replicas",
    "replica": PREFIX + ":{sched}:replica:%s",
    "wake": PREFIX + ":{sched}:wake",
    "metrics_routers": PREFIX + ":{sched}:metrics",
    "autoscaler": PREFIX + ":{sched}:autoscaler",
    "autoscaler_decisions": PREFIX + ":{sched}:autoscaler:decisions",
    "router_metrics": PREFIX + ":{sched}:metrics:%s",
    "nodes": PREFIX + ":{sched}:nodes",
    "router_node": PREFIX + ":{sched}:router:%s",
    "adapters": PREFIX + ":adapters",
    "pools": PREFIX + ":{sched}:pools",
    "response": PREFIX + ":{%s}:resp:%s",
    "responses": PREFIX + ":{%s}:resps",
    "usage": PREFIX + ":{%s}:usage:%s",
    "audit": PREFIX + ":audit",
    "admin_token": PREFIX + ":admintoken:%s",
    "admin_tokens": PREFIX + ":admintokens",
    "file_admin_tokens": PREFIX + ":admintokens:file",
}

# What every script is compiled with: the templates, and the TTLs and limits it applies.
SCRIPT_CONSTANTS: dict[str, str | int] = {
    **_TEMPLATES,
    "resume_window_s": RESUME_WINDOW_S,
    "idempotency_ttl_s": IDEMPOTENCY_TTL_S,
    "stream_idle_ttl_s": STREAM_IDLE_TTL_S,
    "budget_ttl_s": BUDGET_DAY_TTL_S,
    "dead_ttl_s": DEAD_LETTER_TTL_S,
    "stream_max_events": STREAM_MAX_EVENTS,
    "reader_retry_ms": READER_RETRY_MS,
    "max_readers_per_request": MAX_READERS_PER_REQUEST,
    "max_adapters": MAX_ADAPTERS,
    "usage_ttl_s": USAGE_RETENTION_DAYS * 86_400,
}


def detached() -> str:
    return _TEMPLATES["detached"]


def readers() -> str:
    return _TEMPLATES["readers"]


def check_tenant_id(tenant_id: str) -> str:
    if not isinstance(tenant_id, str) or not TENANT_ID_PATTERN.match(tenant_id):
        raise InvalidRequestError(
            f"invalid tenant id {tenant_id!r}: 1-63 of a-z, 0-9, '_' and '-', starting with a "
            "letter or digit",
            param="tenant",
        )
    return tenant_id


def check_pool(pool: str) -> str:
    """A pool's name (a model's, as the settings name it): "" is the default model's."""
    if not isinstance(pool, str) or (pool and not POOL_PATTERN.match(pool)):
        raise InvalidRequestError(
            f"invalid pool {pool!r}: 1-64 of A-Z, a-z, 0-9, '.', '_' and '-', starting with a "
            "letter or digit", param="model")
    return pool


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not REQUEST_ID_PATTERN.match(request_id):
        raise InvalidRequestError(
            f"invalid request id {request_id!r}: 1-128 of A-Z, a-z, 0-9, '.', '_' and '-'",
            param="request_id",
        )
    return request_id


def tenant(tenant_id: str) -> str:
    return _TEMPLATES["tenant"] % check_tenant_id(tenant_id)


def api_keys(tenant_id: str) -> str:
    return _TEMPLATES["api_keys"] % check_tenant_id(tenant_id)


def state(tenant_id: str) -> str:
    return _TEMPLATES["state"] % check_tenant_id(tenant_id)


def _in_pool(name: str, pool: str) -> str:
    return name + ":" + check_pool(pool) if pool else name


def queue(tenant_id: str, pool: str = "") -> str:
    return _in_pool(_TEMPLATES["queue"] % check_tenant_id(tenant_id), pool)


def request(tenant_id: str, request_id: str) -> str:
    return _TEMPLATES["request"] % (check_tenant_id(tenant_id), check_request_id(request_id))


def stream(tenant_id: str, request_id: str) -> str:
    return _TEMPLATES["stream"] % (check_tenant_id(tenant_id), check_request_id(request_id))


def idempotency(tenant_id: str, request_id: str) -> str:
    return _TEMPLATES["idempotency"] % (check_tenant_id(tenant_id), check_request_id(request_id))


def admin_token(token_digest: str) -> str:
    """An admin token by the SHA-256 digest of its secret (router/state/admin_tokens.py)."""
    return _TEMPLATES["admin_token"] % token_digest


def admin_tokens() -> str:
    """Every admin token's id -> digest (at most MAX_ADMIN_TOKENS)."""
    return _TEMPLATES["admin_tokens"]


def file_admin_tokens() -> str:
    """The ids of the admin tokens the tokens file added (at most MAX_ADMIN_TOKENS)."""
    return _TEMPLATES["file_admin_tokens"]


def audit() -> str:
    """The audit log (router/state/audit.py): a stream, trimmed by count and age."""
    return _TEMPLATES["audit"]


def usage(tenant_id: str, hour: int) -> str:
    """One tenant's usage record of one UTC hour (``hour``: ms since the epoch // HOUR_MS):
    a hash of ``<model>|<counter>`` (router/state/usage.py)."""
    return _TEMPLATES["usage"] % (check_tenant_id(tenant_id), hour)


def budget(tenant_id: str, day: int) -> str:
    return _TEMPLATES["budget"] % (check_tenant_id(tenant_id), day)


def dead(tenant_id: str) -> str:
    return _TEMPLATES["dead"] % check_tenant_id(tenant_id)


def stats(tenant_id: str) -> str:
    return _TEMPLATES["stats"] % check_tenant_id(tenant_id)


def tenants() -> str:
    return _TEMPLATES["tenants"]


def file_tenants() -> str:
    return _TEMPLATES["file_tenants"]


def api_key(digest_hex: str) -> str:
    return _TEMPLATES["api_key"] % digest_hex


def classes(pool: str = "") -> str:
    return _in_pool(_TEMPLATES["classes"], pool)


def ready(priority: int, pool: str = "") -> str:
    return _in_pool(_TEMPLATES["ready"] % priority, pool)


def response(tenant_id: str, response_id: str) -> str:
    """STRING: a stored response and its conversation (router/state/responses.py)."""
    return _TEMPLATES["response"] % (check_tenant_id(tenant_id), response_id)


def responses(tenant_id: str) -> str:
    """ZSET: the tenant's stored responses by creation (ms), at most the settings' bound."""
    return _TEMPLATES["responses"] % check_tenant_id(tenant_id)


def pools() -> str:
    return _TEMPLATES["pools"]


def leases(pool: str = "") -> str:
    return _in_pool(_TEMPLATES["leases"], pool)


def replicas() -> str:
    return _TEMPLATES["replicas"]


def replica(replica_id: str) -> str:
    return _TEMPLATES["replica"] % replica_id


def wake_channel() -> str:
    return _TEMPLATES["wake"]


def autoscaler(pool: str = "") -> str:
    """The autoscaler's last decision with its inputs (JSON, expires), of one model's
    replicas (``pool``; "": the default model's)."""
    # NOTE: ":model:" before the pool, so no model's name reaches the decisions' key
    return _TEMPLATES["autoscaler"] + (":model:" + check_pool(pool) if pool else "")


def nodes() -> str:
    """The Ray nodes as a router last saw them (JSON, ``router/state/nodes.py``; expires)."""
    return _TEMPLATES["nodes"]


def adapters() -> str:
    """HASH: the LoRA adapters added at run time, name -> JSON (``router/state/adapters.py``;
    at most ``adapters.MAX_ADAPTERS``; kept until removed)."""
    return _TEMPLATES["adapters"]


def router_node(holder: str) -> str:
    """Where a router runs (its host or pod and Ray node; expires with ``nodes.TTL_S``)."""
    return _TEMPLATES["router_node"] % holder


def autoscaler_decisions(pool: str = "") -> str:
    """HASH: the autoscaler's decisions counted by direction (up, down, hold), of one
    model's replicas (expires ``cluster.autoscaling.DECISION_COUNTS_TTL_S`` after the last)."""
    return _in_pool(_TEMPLATES["autoscaler_decisions"], pool)


def metrics_routers() -> str:
    """SET of the routers that publish metrics snapshots."""
    return _TEMPLATES["metrics_routers"]


def router_metrics(holder: str) -> str:
    """One router's metrics snapshot (JSON, expires after ``router.telemetry.metrics.SNAPSHOT_TTL_S``)."""
    return _TEMPLATES["router_metrics"] % holder

