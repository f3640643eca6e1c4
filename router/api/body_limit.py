"""The request body limit: an ASGI middleware that refuses bodies over ``api.max_body_bytes``
with a 413 and OpenAI's error body, before any parser reads them."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """Refuses bodies over ``max_bytes`` with 413: by Content-Length, or, for a body sent
    without one (chunked), as it comes in. The body is read whole before the app runs (it
    is at most ``max_bytes``), so no parser sees a cut one."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if is_replayed:
                return await receive()  # after the body: the disconnect, when it comes
            is_replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {
            "message": f"request body over {self.max_bytes} bytes", "type": "invalid_request_error",
            "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
