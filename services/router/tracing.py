"""The HTTP API continues its caller's trace: W3C ``traceparent`` / ``tracestate`` headers.

A pure ASGI middleware, so whatever FastAPI or Starlette do (or do not do) with those
headers in a given version plays no part: the request is handled with the caller's
context attached, and the pipeline's ``router.request`` span (started in a task that
copies that context) is the caller's span's child. Without the headers it is a new trace.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context, propagate


class TraceContextMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {
            key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]
        }
        token = context.attach(propagate.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            context.detach(token)
