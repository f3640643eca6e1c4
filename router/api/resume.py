"""Resuming: ``GET /v1/chat/completions/{id}`` (and ``/v1/completions/{id}``; the id is
``X-Fairserve-Request-Id``).

A client that lost its stream asks for what followed the last id it saw, with the
``Last-Event-ID`` header (or ``starting_after``), and ``stream=true``; or by sending the
request again with the same ``Idempotency-Key`` (``routes.py``). Without ``stream``, the GET
waits for the completion and returns it. Only the tenant that made the request can read it
(another key: 404).
"""

from __future__ import annotations

from typing import Any

from router.api.reply import reply
from router.dispatch.streams import ReadPoint
from router.errors import NotFoundError, RouterError
from router.messages import ReaderKind
from router.service import RouterService
from router.state.api_keys import Principal
from router.telemetry.request_observer import RequestObserver


async def resume(service: RouterService, is_chat: bool, request_id: str, stream: bool,
                 position: str | None, param: str, authorization: str | None) -> Any:
    """``GET /v1/chat/completions/{id}`` (and completions): the request, from ``position``."""
    observer = RequestObserver(service.metrics, None)
    try:
        principal: Principal = await service.authenticate(authorization)
        observer.tenant = principal.tenant_id
        shape = await service.shape_of(principal.tenant_id, request_id)
        if shape.is_chat != is_chat:
            raise NotFoundError(f"no such {'chat completion' if is_chat else 'completion'} "
                                f"{request_id!r}", param="request_id")
        point = (await service.position(principal.tenant_id, request_id, position, param)
                 if position else ReadPoint())
        reader = await service.attach(principal.tenant_id, request_id, ReaderKind.RESUME)
    except RouterError as exc:
        observer.refused(exc)
        raise
    return await reply(service, reader, shape, observer, stream, point)
