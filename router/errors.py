"""The router's exceptions. Each maps to one OpenAI error body and HTTP status (in one place,
the HTTP layer); ``status`` and ``code`` here say which."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.state.rate_limits import RateLimits

# 400 codes of the rules the OpenAPI document cannot state: they depend on the prompt's tokens,
# on the tenant, on the grammar compiler, or compare two fields
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's own code
MIN_TOKENS_OVER_MAX_TOKENS = "min_tokens_over_max_tokens"
MAX_TOKENS_OVER_TENANT_CAP = "max_tokens_over_tenant_cap"
UNSUPPORTED_SCHEMA = "unsupported_schema"
PAST_THE_STREAM = "event_id_past_the_stream"  # a resume position after the stream's last event
# a name that must refer to something else in the request (a tool_choice to a tool, a tool
# message to a call made before it, a tool name used once) or in the tenant's state
TOOL_REFERENCE = "tool_reference_not_found"
PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
CONVERSATION_TOO_LARGE = "conversation_too_large"
UNSTATED_RULES = frozenset({CONTEXT_LENGTH_EXCEEDED, MIN_TOKENS_OVER_MAX_TOKENS,
                            MAX_TOKENS_OVER_TENANT_CAP, UNSUPPORTED_SCHEMA, PAST_THE_STREAM,
                            TOOL_REFERENCE, PREVIOUS_RESPONSE_NOT_FOUND,
                            CONVERSATION_TOO_LARGE})


class RouterError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


def error_body(exc: RouterError) -> dict[str, Any]:
    """OpenAI's error body of ``exc``: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                      "code": exc.code}}


class InvalidRequestError(RouterError):
    """Bad input, naming the offending field in ``param``. ``code`` names the rules the
    OpenAPI document cannot state (they depend on the prompt's tokens or compare fields)."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(RouterError):
    """No API key, or one that is unknown or revoked."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDeniedError(RouterError):
    """The key is valid but not for what it asked (another tenant, a disabled tenant)."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class NotFoundError(RouterError):
    """No such tenant or request (for this tenant: other tenants' requests are invisible)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ConflictError(RouterError):
    """The operation does not fit the current state (an id reused for another request)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class IdempotencyKeyReusedError(RouterError):
    """An Idempotency-Key sent again with another request (the IETF draft's 422)."""

    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class IdempotencyKeyExpiredError(RouterError):
    """An Idempotency-Key sent again after its request's result stopped being kept: the key is
    remembered longer (so the request never runs twice), the result is not."""

    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_expired"


class RequestTooLargeError(RouterError):
    """The request alone exceeds a limit that time will not lift (TPM, daily budget)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimitError(RouterError):
    """A quota was hit or the tenant's queue is full; retry after ``retry_after_s``."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, reason: str, retry_after_s: float,
                 limits: RateLimits | None = None) -> None:
        super().__init__(message)
        self.code = reason
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.limits = limits  # the tenant's limiters when it was refused

    def headers(self, later_s: float = 0.0) -> dict[str, str]:
        """The tenant's rate-limit headers (x-ratelimit-*), ``later_s`` after the refusal."""
        if self.limits is None:
            return {}
        return self.limits.later(later_s * 1000).headers()


class StoredDataError(RouterError):
    """Data in Redis is malformed (hand-edited, or written by an incompatible version)."""

    status = 500
    type = "server_error"
    code = "stored_data_error"


class LeaseLostError(RouterError):
    """A dispatcher acted on a request whose lease it no longer holds."""

    status = 409
    type = "server_error"
    code = "lease_lost"


class StreamGapError(RouterError):
    """A replica's chunk does not follow what its response stream holds: a Redis failover lost
    the last appends (replication is asynchronous). The dispatcher reads the stream back and
    has the rest made again (a migration); the client never sees this."""

    status = 503
    type = "server_error"
    code = "stream_gap"


class StreamIdleError(RouterError):
    """A request's stream had no event for the stream idle timeout: this reader stops waiting.
    The request itself goes on, detached: a client may resume it, or it is cancelled after
    the detach grace period."""

    status = 504
    type = "server_error"
    code = "stream_idle_timeout"


class ReplicaUnavailableError(RouterError):
    """A replica died or could not be reached; the request can run elsewhere."""

    status = 503
    type = "server_error"
    code = "replica_unavailable"


class ReplicaFailedError(RouterError):
    """A replica refused or failed a request in a way another replica would repeat."""

    status = 500
    type = "server_error"
    code = "replica_failed"


class OverloadedError(RouterError):
    """The cluster cannot take requests now (Redis unreachable); retry after
    ``retry_after_s`` (with the same Idempotency-Key, in case the admission did land)."""

    status = 503
    type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreFullError(OverloadedError):
    """Redis is at its ``maxmemory`` (``noeviction``): nothing new is written until ended
    requests' records expire or an operator adds memory; nothing already accepted is lost."""

    code = "store_full"
    RETRY_AFTER_S = 5.0

    def __init__(self, detail: str) -> None:
        super().__init__("the queue store is full (Redis at its maxmemory): new requests are "
                         f"refused until ended ones expire; retry later ({detail})",
                         self.RETRY_AFTER_S)


class NotReplicatedError(OverloadedError):
    """An admission was written to the Redis primary but not copied to
    ``queues.replicas_to_ack`` replicas in time (``WAIT``), so a failover could lose it: the
    client is not told it was accepted, and retries (with the same Idempotency-Key it joins the
    request if the admission survived)."""

    code = "not_replicated"

    def __init__(self, acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(f"the request was not copied to {wanted} Redis replica(s) within "
                         f"{timeout_ms} ms ({acked} acknowledged): retry with the same "
                         "Idempotency-Key", 1.0)
