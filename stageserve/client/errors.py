"""A failed call as the ``StageServeError`` class its gRPC status stands for.

The router names its error's class and offending field in the trailing metadata
(``services.common.grpc_errors``); the client raises that class, with the router's message,
``param``, and the call's ``request_id``. A failure without them (no server at the address,
the client's own deadline, a proxy's refusal) gets the class of its status code and gRPC's
own description.
"""

from __future__ import annotations

from typing import Any

import grpc

from services.common.errors import (
    AbortedError,
    CapacityError,
    DeadlineExceededError,
    ErrorRecord,
    InvalidRequestError,
    NotFoundError,
    StageServeError,
    UnauthenticatedError,
    UnavailableError,
)
from services.common.grpc_errors import ERROR_PARAM_KEY, ERROR_TYPE_KEY

CLASS_BY_CODE: dict[grpc.StatusCode, type[StageServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: AbortedError,
}


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item_key, value in metadata or ():
        if item_key == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def error_from_rpc(rpc_error: grpc.RpcError, request_id: str) -> StageServeError:
    """The error a failed ``Router`` call raises (``rpc_error`` becomes its cause)."""
    code = rpc_error.code()
    details = rpc_error.details() or getattr(code, "name", "unknown gRPC status")
    trailing = rpc_error.trailing_metadata()
    record = ErrorRecord(
        _metadata_value(trailing, ERROR_TYPE_KEY) or "",
        details,
        _metadata_value(trailing, ERROR_PARAM_KEY),
    )
    fallback = CLASS_BY_CODE.get(code, StageServeError)
    error = record.to_error(fallback, grpc_code=getattr(code, "name", ""))
    error.request_id = request_id
    error.__cause__ = rpc_error
    return error
