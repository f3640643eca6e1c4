"""The API key of a request, as every route takes it: a bearer key in ``Authorization``
(the OpenAPI document states it as the ``bearer`` scheme). Without one the route answers 401
with OpenAI's body (``RouterService.authenticate``), never FastAPI's own."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                     description="an API key of a tenant (fs-...)")


async def _authorization(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str | None:
    """The Authorization header of a bearer key; None without one (then 401, OpenAI's body)."""
    return None if credentials is None else f"Bearer {credentials.credentials}"


ApiKey = Annotated[str | None, Depends(_authorization)]
