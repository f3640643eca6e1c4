"""The one place where exceptions become OpenAI error bodies: fairserve's own errors
(``RouterError``, with ``Retry-After`` and the rate-limit headers), Redis failures (503, or
``StoreFullError`` when Redis is out of memory), Starlette's and FastAPI's HTTP errors, and
request validation errors (a 400 naming the field as the client sent it, after the key is
checked: without a valid key it is a 401 whatever else is wrong)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from redis.exceptions import OutOfMemoryError, RedisError
from starlette.exceptions import HTTPException

from router.errors import (
    InvalidRequestError,
    OverloadedError,
    RateLimitError,
    RouterError,
    StoreFullError,
    error_body,
)
from router.telemetry.metrics import UNKNOWN_TENANT

if TYPE_CHECKING:
    from router.service import RouterService

logger = logging.getLogger(__name__)


def error_response(exc: RouterError) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))  # whole seconds, up
        if isinstance(exc, RateLimitError):
            headers["X-RateLimit-Reason"] = exc.reason
            headers.update(exc.headers())
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)




def add_error_handlers(app: FastAPI, service: RouterService) -> None:
    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        if exc.status >= 500:
            logger.error("request failed: %s", exc.message)
        return error_response(exc)

    @app.exception_handler(RedisError)
    async def _redis_down(_: Request, exc: RedisError) -> JSONResponse:
        # admission is one script: it ran whole or not at all. If the reply was lost after it
        # ran, a retry with the same Idempotency-Key joins the admitted request
        if isinstance(exc, OutOfMemoryError):
            return error_response(StoreFullError(str(exc)))
        logger.error("Redis unavailable: %s", exc)
        return error_response(OverloadedError(f"the queue store is unavailable: {exc}"))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's and FastAPI's own: no route (404), wrong method (405), a body that
        # cannot be read (400: not UTF-8, ...): OpenAI's error body all the same
        error = RouterError(str(exc.detail), code=_HTTP_CODES.get(exc.status_code))
        error.status = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path (Starlette names one route's)
            headers["Allow"] = ", ".join(_methods_of(app, request.url.path))
        return JSONResponse(error_body(error), status_code=exc.status_code,
                            headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # who asks comes first: without a valid key, 401 whatever else is wrong (as OpenAI)
        try:
            await service.authenticate(request.headers.get("authorization"))
        except RouterError as refused:
            return error_response(refused)
        except (RedisError, OSError):  # keys unreadable now: the 400 is still the answer
            logger.warning("Redis unavailable; answering the invalid request without its key")
        message, param = describe_validation_error(exc.errors())
        service.metrics.inc("fairserve_requests", (UNKNOWN_TENANT, "refused", "invalid_request_error"))
        return JSONResponse(error_body(InvalidRequestError(message, param)), status_code=400)


def _methods_of(app: FastAPI, path: str) -> list[str]:
    """The methods the routes of ``path`` take (one path may have a route per method)."""
    return sorted({method for route in app.routes if isinstance(route, APIRoute)
                   and route.path_regex.match(path) for method in route.methods or ()})


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """OpenAI-style message and ``param`` for the first pydantic error of a request."""
    first = list(errors)[0]
    where = [p for p in first.get("loc", ()) if p != "body"]
    if where and where[0] in ("header", "query", "path"):  # the name as the client sent it
        where = [_PARAMETER_NAMES.get(str(where[1]), where[1])] if len(where) > 1 else []
    # a union reports the branch it tried (str, list[int]); it is not part of the field path
    where = [p for p in where if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".") or None
    kind, message = first.get("type"), str(first.get("msg", "invalid"))
    if kind == "extra_forbidden":
        return f"unsupported field {param!r}: fairserve does not implement it", param
    if kind == "json_invalid":
        return "the body is not valid JSON", None
    if kind == "value_error" and message.startswith("Value error, "):
        field, _, text = message.removeprefix("Value error, ").partition(": ")
        return f"{field}: {text}", field
    if kind == "missing":
        return f"missing required field {param!r}", param
    return f"{param}: {message}" if param else message, param


_PARAMETER_NAMES = {"last-event-id": "Last-Event-ID", "idempotency-key": "Idempotency-Key"}
_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "TextPart"}
