"""How the HTTP API answers and documents errors: OpenAI error bodies for validation failures,
StageServe errors, HTTP errors and unexpected exceptions, and the OpenAPI schema without
FastAPI's 422 answers (validation errors are 400 here)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import StageServeError
from services.router.metrics import RequestTracker, RouterMetrics
from services.router.openai_format import OpenAIJSONResponse, error_body, error_body_of
from services.router.openai_schema import ErrorResponse

# The name these records had before this module split off http_api.
logger = logging.getLogger("services.router.http_api")


def _is_field(part: str | int) -> bool:
    """False for "body" and for pydantic's union-member labels in an error location
    (``str``, ``list[ContentPartBody]``, ``ImageUrl``): body fields are snake_case names."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and not part[:1].isupper() and part not in _TYPE_LABELS


_TYPE_LABELS = {"body", "str", "int", "float", "bool", "none"}


def _field_loc(error: Any) -> list[str | int]:
    return [part for part in error.get("loc", ()) if _is_field(part)]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is invalid", None
    # A union field fails once per member; the error that got deepest names the real problem.
    first = max(errors, key=lambda error: len(_field_loc(error)))
    loc = _field_loc(first)
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if not loc and first.get("type") in ("model_attributes_type", "missing"):
        return (
            "the request body must be a JSON object sent with content-type: application/json",
            None,
        )
    if first.get("type") == "missing":
        return f"{param} is required", param
    if first.get("type") == "extra_forbidden":
        return (
            f"{param} is not a field this server knows (unknown fields are refused, not ignored)",
            param,
        )
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


# Documented answers of the generation routes besides 200 (FastAPI's 422 is never sent).
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the completion; server-sent events when stream is true",
        "content": {"text/event-stream": {}},
    },
    400: {
        "model": ErrorResponse,
        "description": "malformed JSON, or a field missing, mistyped or out of range",
    },
    413: {"model": ErrorResponse, "description": "the body is over --max-request-bytes"},
    429: {"model": ErrorResponse, "description": "overloaded; retry after the Retry-After header"},
    503: {"model": ErrorResponse, "description": "no ready worker, or no capacity for the request"},
    504: {"model": ErrorResponse, "description": "the request's deadline passed"},
}


TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "a field missing, mistyped or out of range"},
    413: GENERATION_RESPONSES[413],
    429: GENERATION_RESPONSES[429],
    503: {"model": ErrorResponse, "description": "no ready tokenizer worker"},
    504: GENERATION_RESPONSES[504],
}


def openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema from the real bodies, less its 422 answers: validation errors are 400."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def install_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    """Answer every error as an OpenAI error body; refused bodies count in ``metrics``."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> OpenAIJSONResponse:
        message, param = validation_message(exc)
        RequestTracker(metrics, request.url.path).finish("invalid_request_error")
        return OpenAIJSONResponse(
            error_body(message, "invalid_request_error", param), status_code=400
        )

    @app.exception_handler(StageServeError)
    async def _stageserve_error(request: Request, exc: StageServeError) -> OpenAIJSONResponse:
        retry_after_s = getattr(exc, "retry_after_s", None)
        headers = (
            None
            if retry_after_s is None
            else {"retry-after": str(max(1, math.ceil(retry_after_s)))}
        )
        return OpenAIJSONResponse(error_body_of(exc), status_code=exc.http_status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> OpenAIJSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return OpenAIJSONResponse(
            error_body(str(exc.detail), error_type), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> OpenAIJSONResponse:
        logger.error(
            "unexpected error answering %s %s", request.method, request.url.path, exc_info=exc
        )
        return OpenAIJSONResponse(
            error_body("internal error in the router", "internal_error"), status_code=500
        )
