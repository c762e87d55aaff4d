"""The router's part of a trace: the caller's context in, the ``router.request`` span's
request attributes.

The HTTP API continues its caller's trace (W3C ``traceparent`` / ``tracestate`` headers)
through a pure ASGI middleware, so whatever FastAPI or Starlette do (or do not do) with those
headers in a given version plays no part: the request is handled with the caller's
context attached, and the pipeline's ``router.request`` span (started in a task that
copies that context) is the caller's span's child. Without the headers it is a new trace.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context, propagate

from services.router.types import GenerationRequest


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


def request_attributes(request: GenerationRequest, model_name: str) -> dict[str, Any]:
    """The ``gen_ai.*`` request attributes of ``router.request`` (OpenTelemetry semconv)."""
    params = request.params
    attributes: dict[str, Any] = {
        "request_id": request.request_id,
        "gen_ai.operation.name": "chat" if request.messages is not None else "text_completion",
        "gen_ai.request.model": model_name,
        "gen_ai.response.model": model_name,
        "gen_ai.response.id": request.request_id,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.frequency_penalty": params.frequency_penalty,
        "gen_ai.request.presence_penalty": params.presence_penalty,
    }
    if params.top_k:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if request.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = request.max_tokens
    if request.stop:
        attributes["gen_ai.request.stop_sequences"] = request.stop
    return attributes
