"""Client side of the gRPC skeleton: channels with commented options, readiness wait.

Channels made here forward the ``x-request-id`` of the RPC being handled (see
``services.common.server.current_request_id``) on every call, so one request id
follows a request across hops, and carry the caller's ``Credentials`` (if any) on
every call of every kind.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from services.common.auth import AUTHORIZATION_KEY, Credentials
from services.common.errors import DeadlineExceededError, NotFoundError, UnavailableError
from services.common.healthcheck import check_async
from services.common.server import MAX_MESSAGE_BYTES, REQUEST_ID_KEY, current_request_id

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    # Requests and responses carry compressed image bytes; match the server's limit.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Ping every 30 s, also between calls, so a dead peer is found in ~40 s instead of
    # at the next request (the server accepts this rate; see SERVER_OPTIONS).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Keep pinging during a long quiet stream (the default stops after 2 pings).
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect to a restarted worker within seconds (the default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # No transparent retries: a retried Prefill or Reserve could run twice; retrying is
    # the router's decision, by the error's class.
    ("grpc.enable_retries", 0),
)


DetailsEdit = Callable[[grpc.aio.ClientCallDetails], grpc.aio.ClientCallDetails]


def _with_request_id(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    request_id = current_request_id.get()
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    if not request_id or REQUEST_ID_KEY in metadata:
        return details
    metadata.add(REQUEST_ID_KEY, request_id)
    return details._replace(metadata=metadata)


def _with_credentials(details: grpc.aio.ClientCallDetails, auth: Credentials) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata[AUTHORIZATION_KEY] = auth.header_value
    return details._replace(metadata=metadata)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, edit: DetailsEdit) -> None:
        self._edit = edit

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._edit(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, edit: DetailsEdit) -> None:
        self._edit = edit

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._edit(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, edit: DetailsEdit) -> None:
        self._edit = edit

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._edit(details), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, edit: DetailsEdit) -> None:
        self._edit = edit

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._edit(details), requests)


def details_interceptors(edit: DetailsEdit) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors applying ``edit`` to the details (metadata) of every call, of all four kinds.

    One object per kind: ``grpc.aio`` files an interceptor under the first kind it
    implements only, so one class implementing several would skip the others.
    """
    return [cls(edit) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def create_channel(
    target: str,
    *,
    auth: Credentials | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """An insecure ``grpc.aio`` channel to ``target`` ("host:port") with ``CHANNEL_OPTIONS``.

    ``auth``: the bearer token sent on every call (None: no ``authorization`` metadata).
    """
    chain = details_interceptors(_with_request_id)
    if auth is not None:
        chain += details_interceptors(functools.partial(_with_credentials, auth=auth))
    return grpc.aio.insecure_channel(
        target, options=CHANNEL_OPTIONS, interceptors=[*chain, *interceptors]
    )


async def wait_ready(
    channel: grpc.aio.Channel,
    timeout_s: float,
    *,
    service: str = "",
    poll_interval_s: float = 0.05,
) -> None:
    """Poll ``grpc.health.v1`` ``Check`` until ``service`` is SERVING.

    Raises ``UnavailableError`` when the peer never answered within ``timeout_s``,
    ``DeadlineExceededError`` when it answered but never became SERVING, and
    ``NotFoundError`` at once when the peer does not know ``service``.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    loop = asyncio.get_running_loop()
    deadline_mono = loop.time() + timeout_s
    last_status: str | None = None  # None: the peer has not answered yet
    last_error = "no attempt"
    while True:
        remaining = deadline_mono - loop.time()
        if remaining <= 0:
            break
        answer = await check_async(stub, service=service, timeout_s=min(remaining, 1.0))
        if answer.is_serving:
            return
        if answer.code == grpc.StatusCode.NOT_FOUND:
            raise NotFoundError(f"peer does not serve {service!r}: {answer.details}")
        if answer.status is None:
            last_error = answer.why_not_serving or last_error
        else:
            last_status = answer.status
        await asyncio.sleep(min(poll_interval_s, max(deadline_mono - loop.time(), 0.0)))
        poll_interval_s = min(poll_interval_s * 2, 0.5)
    if last_status is None:
        raise UnavailableError(f"peer unreachable for {timeout_s:.1f} s ({last_error})")
    raise DeadlineExceededError(
        f"peer not ready after {timeout_s:.1f} s (health status {last_status})"
    )
