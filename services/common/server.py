"""The one gRPC server skeleton every service runs on.

``create_server`` builds a ``grpc.aio`` server with the service's servicers, the
standard ``grpc.health.v1`` health service, the telemetry interceptor, bearer-token
authentication (``services.common.auth``; health is exempt) and, when asked,
reflection, and binds it (port 0 picks a free port and returns it).
``serve_until_signal`` runs it until SIGTERM/SIGINT, then shuts down in order: health
NOT_SERVING -> the service's drain, if it has one (the router: refuse new requests, let the
ones in flight finish within its budget) -> ``server.stop`` with grace (new RPCs refused, the
ones in flight given ``grace_s``) -> the release callback.

Health: liveness is the process answering ``Check`` at all; readiness is ``SERVING``,
which ``HealthState`` reports only after the service calls ``set_serving(True)``
(model loaded, rank group formed, peers reachable). After shutdown starts it stays
NOT_SERVING for good. The health service name ``liveness`` answers SERVING whenever the
process answers at all, whatever readiness says: liveness probes ask for it, so a
process is never restarted for a peer's failure.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context

from services.common import telemetry
from services.common.auth import AuthInterceptor, Credentials
from services.common.errors import UnavailableError

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
REQUEST_ID_KEY = "x-request-id"
# The request id of the RPC being handled (set by the interceptor); clients forward it.
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "current_request_id", default=""
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # Tokenize, Prefill and Encode requests carry compressed image bytes (several MB
    # each, several per request); the 4 MiB default is too small.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Binding a taken port must fail, not silently share traffic with another process.
    ("grpc.so_reuseport", 0),
    # Ping idle connections so a client that died mid-stream (a router holding a
    # decode stream) is noticed and the request's pages are released.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Accept our clients' keepalive pings (every 30 s, also between calls) instead of
    # answering them with GOAWAY "too_many_pings".
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)

LIVENESS_SERVICE = "liveness"  # the health service name liveness probes ask for
# RpcMetrics in the Prometheus form, one set per process (every server of the process adds to it).
_RPC_HANDLED = telemetry.counter(
    "grpc_server_handled",
    "RPCs this process's gRPC servers completed, by method and status code.",
    ("grpc_service", "grpc_method", "grpc_code"),
)
_RPC_SECONDS = telemetry.histogram(
    "grpc_server_handling_seconds",
    "From an RPC's arrival to its end (a stream's last message), by method.",
    ("grpc_service", "grpc_method"),
)

Registration = tuple[
    Callable[[Any, grpc.aio.Server], None], Any
]  # (add_XServicer_to_server, servicer)
_HEALTH = health_pb2.HealthCheckResponse


class HealthState(health_pb2_grpc.HealthServicer):
    """Readiness of this process, served as ``grpc.health.v1`` (``Check`` and ``Watch``).

    Every registered service name (and ``""``, the whole server) shares one status.
    Call its methods from the event loop's thread. ``Watch`` streams end after they
    report the final NOT_SERVING of a shutdown. ``LIVENESS_SERVICE`` is SERVING for as
    long as the server answers, before readiness, while not ready and during shutdown.
    """

    def __init__(self) -> None:
        self._service_names: set[str] = {"", LIVENESS_SERVICE}
        self._is_serving = False
        self._is_shutting_down = False
        self._changed = asyncio.Event()  # replaced on every change; watchers wait on it

    @property
    def is_serving(self) -> bool:
        return self._is_serving

    @property
    def is_shutting_down(self) -> bool:
        return self._is_shutting_down

    def add_service_names(self, names: Iterable[str]) -> None:
        self._service_names.update(names)

    def set_serving(self, is_serving: bool) -> None:
        """Report ready (SERVING) or not (NOT_SERVING); ignored once shutdown has begun."""
        if self._is_shutting_down or is_serving == self._is_serving:
            return
        self._is_serving = is_serving
        self._notify()

    def enter_shutdown(self) -> None:
        """NOT_SERVING from now on, whatever ``set_serving`` is called with later."""
        self._is_shutting_down = True
        if self._is_serving:
            self._is_serving = False
            self._notify()

    def status(self, service: str) -> int:
        if service not in self._service_names:
            return _HEALTH.SERVICE_UNKNOWN
        if service == LIVENESS_SERVICE:
            return _HEALTH.SERVING
        return _HEALTH.SERVING if self._is_serving else _HEALTH.NOT_SERVING

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> _HEALTH:
        if request.service not in self._service_names:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return _HEALTH(status=self.status(request.service))

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> AsyncIterator[_HEALTH]:
        last_status = None
        while True:
            changed = self._changed  # taken before reading the status, so no change is missed
            status = self.status(request.service)
            if status != last_status:
                last_status = status
                yield _HEALTH(status=status)
                continue  # the status may have changed while this message was written
            if self._is_shutting_down:
                return  # NOT_SERVING is sent and final; do not hold the server's grace period
            await changed.wait()


@dataclass
class RpcStats:
    num_calls: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class RpcMetrics:
    """Per-(method, status code) call counts and latencies, in seconds; also exported as
    ``stageserve_grpc_server_handled_total`` and ``stageserve_grpc_server_handling_seconds``."""

    def __init__(self) -> None:
        self._stats: dict[tuple[str, str], RpcStats] = {}

    def record(self, method: str, code: str, elapsed_s: float) -> None:
        stats = self._stats.setdefault((method, code), RpcStats())
        stats.num_calls += 1
        stats.total_s += elapsed_s
        stats.max_s = max(stats.max_s, elapsed_s)
        service, _, name = method.lstrip("/").rpartition("/")  # "/stageserve.v1.Decode/Reserve"
        _RPC_HANDLED.labels(service, name, code).inc()
        _RPC_SECONDS.labels(service, name).observe(elapsed_s)

    def snapshot(self) -> dict[tuple[str, str], RpcStats]:
        return {key: RpcStats(s.num_calls, s.total_s, s.max_s) for key, s in self._stats.items()}

    def num_calls(self, method: str, code: str | None = None) -> int:
        return sum(
            s.num_calls for (m, c), s in self._stats.items() if m == method and code in (None, c)
        )


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item_key, value in metadata or ():
        if item_key == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def _code_name(context: Any) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    """Records every RPC's status and latency into ``metrics``, and binds its request id
    and its caller's trace context.

    The id comes from the ``x-request-id`` metadata key (a fresh one when absent) and
    is visible to the handler, and forwarded by ``services.common.client``, through
    ``current_request_id``. The caller's W3C trace context (``traceparent``) is the
    handler's current context, so its log lines carry the trace id even without a span.
    """

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        request_id = (
            _metadata_value(details.invocation_metadata, REQUEST_ID_KEY) or uuid.uuid4().hex
        )
        caller = telemetry.extract_context(details.invocation_metadata)
        kind = next(
            k
            for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
            if getattr(handler, k)
        )
        behavior = getattr(handler, kind)
        if inspect.isasyncgenfunction(behavior):
            wrapped = self._wrap_stream(behavior, details.method, request_id, caller)
        else:
            wrapped = self._wrap_unary(behavior, details.method, request_id, caller)
        return handler._replace(**{kind: wrapped})

    def _wrap_unary(
        self,
        behavior: Callable[..., Awaitable[Any]],
        method: str,
        request_id: str,
        caller: otel_context.Context,
    ) -> Any:
        async def observed(request: Any, context: Any) -> Any:
            current_request_id.set(request_id)
            otel_context.attach(caller)  # the RPC's own task: nothing to detach
            start, code = time.perf_counter(), "UNKNOWN"
            try:
                response = await behavior(request, context)
                code = _code_name(context)
                return response
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            finally:
                self.metrics.record(method, code, time.perf_counter() - start)

        return observed

    def _wrap_stream(
        self,
        behavior: Callable[..., AsyncIterator[Any]],
        method: str,
        request_id: str,
        caller: otel_context.Context,
    ) -> Any:
        async def observed(request: Any, context: Any) -> AsyncIterator[Any]:
            current_request_id.set(request_id)
            otel_context.attach(caller)  # the RPC's own task: nothing to detach
            start, code = time.perf_counter(), "UNKNOWN"
            try:
                async for response in behavior(request, context):
                    yield response
                code = _code_name(context)
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            finally:
                self.metrics.record(method, code, time.perf_counter() - start)

        return observed


def create_server(
    servicers: Sequence[Registration],
    port: int = 0,
    host: str = "127.0.0.1",
    service_names: Sequence[str] = (),
    *,
    health: HealthState,
    metrics: RpcMetrics | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    auth: Credentials | None = None,
    enable_reflection: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """Build and bind (not start) a server; returns it and the bound port.

    ``servicers`` are ``(add_XServicer_to_server, servicer)`` pairs; ``service_names``
    their full names (``stageserve.v1.Decode``) for health and reflection. ``health``
    starts NOT_SERVING; call ``health.set_serving(True)`` when ready. ``auth``: the
    bearer token every call but a health check must carry (None: no authentication).
    Reflection is served only with ``enable_reflection``. Port 0 binds a free port.
    Raises ``UnavailableError`` when the address cannot be bound.
    """
    chain: list[grpc.aio.ServerInterceptor] = [
        TelemetryInterceptor(metrics if metrics is not None else RpcMetrics())
    ]
    if auth is not None:
        chain.append(AuthInterceptor(auth))
    server = grpc.aio.server(interceptors=[*chain, *interceptors], options=SERVER_OPTIONS)
    for add_to_server, servicer in servicers:
        add_to_server(servicer, server)
    health.add_service_names(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if enable_reflection:
        reflected = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*reflected, reflection.SERVICE_NAME], server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError when it cannot bind
        raise UnavailableError(f"cannot bind gRPC server to {address}: {exc}") from exc
    if bound_port == 0:
        raise UnavailableError(f"cannot bind gRPC server to {address}")
    return server, bound_port


async def shutdown(
    server: grpc.aio.Server,
    health: HealthState,
    on_shutdown: Callable[[], Any] | None = None,
    grace_s: float = 5.0,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """NOT_SERVING -> ``drain`` -> stop accepting RPCs, give in-flight ones ``grace_s`` ->
    release.

    ``drain`` runs while the server still accepts RPCs (the service refuses what it must
    itself) and returns when the work in flight is done or its budget is spent.
    ``on_shutdown`` (sync or async) releases what the service holds (engine, rank
    group, transfer sessions); it runs once, after the server has stopped.
    """
    health.enter_shutdown()
    try:
        if drain is not None:
            await drain()
        await server.stop(grace_s)
    finally:
        if on_shutdown is not None:
            result = on_shutdown()
            if inspect.isawaitable(result):
                await result


async def serve_until_signal(
    server: grpc.aio.Server,
    health: HealthState,
    on_shutdown: Callable[[], Any] | None = None,
    *,
    grace_s: float = 5.0,
    drain: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Serve a started server until a signal (or ``stop`` is set, or it terminates), then ``shutdown``.

    Only the first signal is handled: a second one during the grace period gets the
    default action (terminate now).
    """
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    stop_task = asyncio.ensure_future(stop.wait())
    # Shielded: cancelling a wait_for_termination() call cancels grpc's shared shutdown
    # future, and the server.stop() below would then raise CancelledError.
    terminated = asyncio.shield(server.wait_for_termination())
    try:
        await asyncio.wait({stop_task, terminated}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for task in (stop_task, terminated):
            task.cancel()
    logger.info("shutting down (grace %.1f s)", grace_s)
    await shutdown(server, health, on_shutdown, grace_s, drain)
