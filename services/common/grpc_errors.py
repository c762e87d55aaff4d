"""StageServeError <-> gRPC status, both ways, and the servicer last-resort handler.

Server side: ``abort_with_error`` ends an RPC with the error's ``grpc_code`` and message,
and ``handle_errors`` wraps every servicer method (coroutine or async generator) so a
``StageServeError`` becomes its mapped status and anything else becomes ``INTERNAL``
with the traceback logged (its text is not sent: it can name internals). The error's
class name and ``param`` ride in trailing metadata, so ``error_from_rpc`` on the client
rebuilds the same class; a failure without them (the transport's, the caller's own
deadline, a foreign server) gets a generic message, since gRPC's details name internal
addresses (``ipv4:10.0.0.7:50051: Connection refused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from services.common import errors
from services.common.errors import (
    MAX_MESSAGE_CHARS,
    MAX_PARAM_CHARS,
    ErrorRecord,
    StageServeError,
    clip,
)

logger = logging.getLogger(__name__)

ERROR_TYPE_KEY = "x-stageserve-error"  # trailing metadata: the error's class name
ERROR_PARAM_KEY = "x-stageserve-error-param"  # trailing metadata: the offending request field

# The class a bare status code maps back to when the server sent no class name
# (a transport failure, a deadline the client's own stack raised, a foreign server).
_CLASS_BY_CODE: dict[grpc.StatusCode, type[StageServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.CANCELLED: errors.AbortedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.ModelLoadError,
}

F = TypeVar("F", bound=Callable[..., Any])


def status_code_of(error: StageServeError) -> grpc.StatusCode:
    """The gRPC status code an error maps to (its class's ``grpc_code``)."""
    code = getattr(grpc.StatusCode, error.grpc_code, None)
    assert isinstance(code, grpc.StatusCode), (
        f"{type(error).__name__}.grpc_code={error.grpc_code!r}"
    )
    return code


def error_metadata(error: StageServeError) -> tuple[tuple[str, str], ...]:
    pairs = [(ERROR_TYPE_KEY, type(error).__name__)]
    if error.param is not None:
        pairs.append((ERROR_PARAM_KEY, clip(error.param, MAX_PARAM_CHARS)))
    return tuple(pairs)


async def abort_with_error(context: grpc.aio.ServicerContext, error: StageServeError) -> NoReturn:
    """End the RPC with ``error``'s status code and message (clipped: ``errors.clip``); never
    returns."""
    message = clip(error.message, MAX_MESSAGE_CHARS)
    await context.abort(status_code_of(error), message, error_metadata(error))
    raise AssertionError("context.abort returned")  # grpc raises AbortError above


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item_key, value in metadata or ():
        if item_key == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def error_from_rpc(rpc_error: grpc.RpcError, service: str = "") -> StageServeError:
    """The ``StageServeError`` a failed call to ``service`` (a kind: "decode") stands for.

    With the server's error class in the trailing metadata: that class, the server's
    message and ``param``. Without it: the class of the status code and a generic message
    naming ``service``; gRPC's details are logged, never put in the message.
    """
    code = rpc_error.code()
    trailing = rpc_error.trailing_metadata()
    if (
        code == grpc.StatusCode.UNAUTHENTICATED
    ):  # our own credentials: a deployment error, not the caller's
        name = f"the {service} service" if service else "a backend service"
        error = errors.CredentialsRefusedError(
            f"{name} refused this service's internal credentials (check STAGESERVE_INTERNAL_TOKEN)"
        )
        error.__cause__ = rpc_error
        return error
    record = ErrorRecord(
        _metadata_value(trailing, ERROR_TYPE_KEY) or "",
        rpc_error.details() or getattr(code, "name", ""),
        _metadata_value(trailing, ERROR_PARAM_KEY),
    )
    code_name = getattr(code, "name", "")  # "": no class matches
    if record.error_class(code_name) is not None:
        error = record.to_error(grpc_code=code_name)
    else:
        details = rpc_error.details()
        logger.info("gRPC call to %s failed: %s: %s", service or "a service", code, details)
        error = _CLASS_BY_CODE.get(code, StageServeError)(_generic_message(code, service))
    error.__cause__ = rpc_error
    return error


def _generic_message(code: grpc.StatusCode | None, service: str) -> str:
    name = f"the {service} service" if service else "a backend service"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{name} is unavailable"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{name} did not answer before the deadline"
    if code == grpc.StatusCode.CANCELLED:
        return f"the call to {name} was cancelled"
    return f"the call to {name} failed ({getattr(code, 'name', 'unknown status')})"


async def _abort_unexpected(
    context: grpc.aio.ServicerContext, name: str, exc: Exception
) -> NoReturn:
    logger.exception("unexpected error in %s", name)
    error = StageServeError(f"internal error in {name} (the service log has the details)")
    await context.abort(grpc.StatusCode.INTERNAL, error.message, error_metadata(error))
    raise AssertionError("context.abort returned")


@contextlib.asynccontextmanager
async def _aborting_on_error(context: grpc.aio.ServicerContext, name: str) -> AsyncIterator[None]:
    try:
        yield
    except StageServeError as exc:
        await abort_with_error(context, exc)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:  # the servicer's last-resort handler
        await _abort_unexpected(context, name, exc)


def handle_errors(method: F) -> F:
    """Wrap a servicer method (``async def`` or async generator) so it always ends with a status.

    ``StageServeError`` -> its mapped code and message; ``grpc.aio.AbortError`` (the
    method aborted itself) and cancellation pass through; anything else -> ``INTERNAL``
    with the traceback logged. The context is the method's last positional argument.
    """
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(*args: Any) -> AsyncIterator[Any]:
            async with _aborting_on_error(args[-1], name):
                async for item in method(*args):
                    yield item

        return stream_wrapper  # type: ignore[return-value]

    if not inspect.iscoroutinefunction(method):
        raise TypeError(f"handle_errors wraps async servicer methods, got {name}")

    @functools.wraps(method)
    async def unary_wrapper(*args: Any) -> Any:
        async with _aborting_on_error(args[-1], name):
            return await method(*args)

    return unary_wrapper  # type: ignore[return-value]
