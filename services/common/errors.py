"""One exception hierarchy for the world outside the process.

Internal invariants use ``assert``. Everything a caller can cause or observe (bad
input, capacity, an unavailable peer, a timeout) is a ``StageServeError`` subclass;
callers decide retries by its class. One function maps it to a gRPC status code; the
router maps that to an OpenAI-style HTTP error.

An error crossing a process (a rank's reply, a Stream's end, gRPC trailers, an encoder
job's failure) travels as an ``ErrorRecord`` and becomes its own class again on the other
side (``ErrorRecord.to_error``).
"""

from __future__ import annotations

import msgspec

# Error text sent to a caller may echo the caller's strings (a model name, a field name, a
# media type): rendered messages and params are clipped to these lengths (``clip``).
MAX_MESSAGE_CHARS = 600
MAX_PARAM_CHARS = 200


def clip(text: str, limit: int) -> str:
    """``text`` if at most ``limit`` characters, else its head and tail around a note of the
    original length (an echoed client string is cut, the explanation after it is kept)."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 2 // 3], text[len(text) - limit // 3 :]
    return f"{head}...[{len(text)} characters, cut]...{tail}"


class StageServeError(Exception):
    """Base of every error that crosses a service boundary."""

    grpc_code: str = "INTERNAL"  # name of a grpc.StatusCode member
    http_status: int = 500
    openai_type: str = "internal_error"
    # The failed request's id, on the errors ``stageserve.client`` raises; None elsewhere.
    request_id: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(StageServeError):
    """The request itself is wrong; retrying it unchanged fails again."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"


class NotFoundError(StageServeError):
    """A named thing (model, request) does not exist."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "invalid_request_error"


class CapacityError(StageServeError):
    """Not enough of a scarce resource (KV pages, slots, cache bytes) right now."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 503
    openai_type = "server_overloaded"


class OverloadedError(CapacityError):
    """The service admits no more requests right now; the caller should retry after
    ``retry_after_s``."""

    http_status = 429
    openai_type = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class UnauthenticatedError(StageServeError):
    """The caller presented no credentials or wrong ones."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    openai_type = "invalid_request_error"
    code = "invalid_api_key"


class CredentialsRefusedError(StageServeError):
    """A peer refused this service's internal credentials: a deployment error, never the end
    client's."""


class UnavailableError(StageServeError):
    """A peer is down, not ready, or went away mid-request."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "service_unavailable"


class DeadlineExceededError(StageServeError):
    """The request's deadline passed before it finished."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_type = "timeout"


class AbortedError(StageServeError):
    """The request was aborted (client disconnect, explicit abort)."""

    grpc_code = "CANCELLED"
    http_status = 499
    openai_type = "cancelled"


class ImageDataNeededError(StageServeError):
    """A worker was sent an image by hash alone and does not hold its bytes; nothing happened, and
    the caller sends the call again with them (internal: never a client's error)."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 500
    openai_type = "internal_error"


class ModelLoadError(StageServeError):
    """A checkpoint directory cannot be loaded as asked (missing, extra or mis-shaped tensor, unknown architecture)."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 500
    openai_type = "internal_error"


def _known_error_classes() -> dict[str, type[StageServeError]]:
    """Every ``StageServeError`` class of this process, by class name."""
    found: dict[str, type[StageServeError]] = {}
    pending: list[type[StageServeError]] = [StageServeError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.__name__, cls)
        pending.extend(cls.__subclasses__())
    return found


class ErrorRecord(msgspec.Struct, frozen=True):
    """A ``StageServeError`` as data: its class name, message and ``param``."""

    error_type: str  # a StageServeError class name; "" or one this process lacks: the fallback
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: StageServeError) -> ErrorRecord:
        return cls(type(error).__name__, error.message, error.param)

    def error_class(self, grpc_code: str | None = None) -> type[StageServeError] | None:
        """The class ``error_type`` names, if this process knows it and (given ``grpc_code``)
        it maps to that status code; else None."""
        cls = _known_error_classes().get(self.error_type)
        if cls is None or (grpc_code is not None and cls.grpc_code != grpc_code):
            return None
        return cls

    def to_error(
        self, fallback: type[StageServeError] = StageServeError, grpc_code: str | None = None
    ) -> StageServeError:
        """The error again, with its message and ``param``: its own class (``error_class``),
        else ``fallback``."""
        return (self.error_class(grpc_code) or fallback)(self.message, param=self.param)
