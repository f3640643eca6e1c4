"""Settings of the tenant queues (a branch of the cluster's settings tree)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from router.state import audit, keys
from router.state.responses import ResponsesSettings


class QueueSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_ms: int = Field(
        30_000, ge=100, le=3_600_000,
        description="how long a grant is held without renewal before the reaper requeues it",
    )
    max_deliveries: int = Field(
        3, ge=1, le=100, description="grants of one request before it is dead-lettered"
    )
    max_grants_per_call: int = Field(
        32, ge=1, le=1000, description="most requests one grant call hands out"
    )
    reap_batch: int = Field(500, ge=1, le=100_000, description="expired leases looked at per reap")
    queue_full_retry_after_ms: int = Field(
        1_000, ge=0, le=600_000, description="Retry-After sent when a tenant's queue is full"
    )
    resume_window_s: int = Field(
        keys.RESUME_WINDOW_S, ge=60, le=keys.IDEMPOTENCY_TTL_S,
        description="how long an ended request can still be read (resume, Idempotency-Key "
        "replay): its record and its stream expire together then; an Idempotency-Key is "
        "remembered 24 h, so a later retry gets a 409, never a second run")
    usage_retention_days: int = Field(
        keys.USAGE_RETENTION_DAYS, ge=0, le=800,
        description="how long the hourly usage records per tenant and model are kept "
        "(fs:{t}:usage:<hour>: requests, prompt, cached and completion tokens, queue and engine "
        "ms, errors, refusals; `fairserve usage`); 0: none are written")
    audit_retention_days: int = Field(
        audit.RETENTION_DAYS, ge=1, le=3650,
        description="how long entries of the audit log (fs:audit: every administrative change, "
        "its actor, before and after) are kept; `fairserve audit` reads them")
    audit_max_entries: int = Field(
        audit.MAX_ENTRIES, ge=100, le=10_000_000,
        description="most entries the audit log keeps (the oldest go first)")
    replicas_to_ack: int = Field(
        0, ge=0, le=16,
        description="Redis replicas that must hold an admission before the client is told it "
        "was accepted (Redis WAIT after the admission): with a primary, its replicas and "
        "Sentinel, an acknowledged request then survives a failover; 0: the primary's word "
        "(and its appendfsync) is enough")
    ack_timeout_ms: int = Field(
        500, ge=1, le=60_000, description="how long an admission waits for those replicas; "
        "past it the client gets 503 not_replicated and retries")


class ApiSettings(BaseModel):
    """Limits the HTTP API applies before anything is queued."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, le=64 * 1024 * 1024,
        description="largest request body; a larger one is refused with 413",
    )
    max_requests_per_tenant: int = Field(
        600, ge=1, le=100_000,
        description="HTTP requests of one tenant a router holds at once (streams, resumes, "
        "requests being admitted); past it a 429 at once, before the body is read, so one "
        "tenant cannot take the router's slots (router.max_ongoing_requests). Keep it at least "
        "the tenants' max_streams + max_resumes")
    stream_idle_timeout_s: float = Field(
        600.0, gt=0, description="a response with no event for this long ends with an error"
    )
    allow_scale_from_zero: bool = Field(
        False, description="/ready is true with no replica running (autoscaling starts one)"
    )
    detach_grace_s: float = Field(
        30.0, ge=0, le=3600,
        description="a request whose client went away goes on this long (the client may "
        "resume it), then is cancelled and refunded; 0: at once",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="address each router serves GET /metrics on: the operators' "
        "port, never the tenants' (the exposition names every tenant); the Helm chart: 0.0.0.0, "
        "reached by its PodMonitor only")
    metrics_port: int | None = Field(
        9464, ge=1, le=65535, description="port of /metrics; the routers of one machine share "
        "it (SO_REUSEPORT) and any answers with the whole cluster's metrics; null: not served")
    admin_host: str = Field(
        "127.0.0.1", description="address each router serves the admin API on (/admin/v1/: "
        "tenants, keys, usage, audit; admin tokens only): the operators' side, never the "
        "tenants' port")
    admin_port: int | None = Field(
        9466, ge=1, le=65535, description="port of the admin API; the routers of one machine "
        "share it (SO_REUSEPORT); null: not served")
    admin_tokens_file: str | None = Field(
        None, description="a file of admin tokens as SHA-256 digests (`fairserve admin "
        "token-new` makes a token and its entry), reconciled at every start: its tokens added, "
        "a token it no longer lists revoked; null: tokens are made with `fairserve admin "
        "token-create` only")
    max_n: int = Field(
        8, ge=1, le=128,
        description="most choices (OpenAI's n) one request may ask for; each is a sequence in "
        "the engine, so it must not exceed engine.max_num_seqs",
    )
    responses: ResponsesSettings = Field(
        default_factory=ResponsesSettings, description="stored responses of POST /v1/responses "
        "(router/state/responses.py): how long, how many per tenant, how large")
