"""Who may call the router, and with what it calls the workers.

The public API (HTTP ``/v1/*`` and gRPC ``stageserve.v1.Router``) requires the API key,
when one is set, as ``Authorization: Bearer <key>``; ``GET /health`` and gRPC health
stay open for probes, but ``/health`` details workers and load only to callers with the
key (``is_authorized``). Calls to the workers carry the internal token instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.common.auth import AUTHORIZATION_KEY, Credentials
from services.common.errors import UnauthenticatedError
from services.router.openai_format import error_body_of

OPEN_PATHS = frozenset({"/health"})  # every other HTTP path needs the API key
_AUTHORIZATION_HEADER = AUTHORIZATION_KEY.encode()
_AUTHORIZED_SCOPE_KEY = "stageserve.authorized"  # set by ApiKeyMiddleware on OPEN_PATHS


@dataclass(frozen=True)
class RouterAccess:
    """The router's secrets and exposure, built once at start-up from flags and Envs."""

    internal: Credentials | None = None  # sent to every worker; None: --allow-unauthenticated
    api_key: Credentials | None = None  # required from API callers; None: the API is open
    enable_reflection: bool = False  # gRPC server reflection on the public port


class ApiKeyMiddleware:
    """ASGI middleware: an HTTP request outside ``OPEN_PATHS`` without the API key gets 401.

    The 401 carries the OpenAI error body of ``UnauthenticatedError``
    (``invalid_request_error`` / ``invalid_api_key``) and ``WWW-Authenticate: Bearer``;
    the request never reaches a route, so nothing of it is parsed. A request to an open
    path goes on either way, marked with whether it carried the key (``is_authorized``).
    """

    def __init__(self, app: Any, api_key: Credentials) -> None:
        self._app = app
        self._api_key = api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        is_authorized = self._is_authorized(scope)
        if scope["path"] in OPEN_PATHS:
            await self._app({**scope, _AUTHORIZED_SCOPE_KEY: is_authorized}, receive, send)
            return
        if is_authorized:
            await self._app(scope, receive, send)
            return
        error = UnauthenticatedError(self._api_key.denied_message)
        response = JSONResponse(
            error_body_of(error),
            status_code=error.http_status,
            headers={"www-authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _is_authorized(self, scope: dict[str, Any]) -> bool:
        values = [value for name, value in scope["headers"] if name == _AUTHORIZATION_HEADER]
        return len(values) == 1 and self._api_key.accepts(values[0])


def is_authorized(scope: dict[str, Any]) -> bool:
    """Whether the HTTP request of ``scope`` may see more than a status: it carried the API
    key, or the API has none (no ``ApiKeyMiddleware`` marked it)."""
    return bool(scope.get(_AUTHORIZED_SCOPE_KEY, True))


def require_api_key(app: FastAPI, api_key: Credentials | None) -> None:
    """Guard ``app`` with ``ApiKeyMiddleware`` (no-op without a key); call before it serves."""
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
