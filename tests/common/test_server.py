"""The shared gRPC skeleton: health, reflection (off unless enabled), error mapping, telemetry,
graceful stop."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace

from services.common.auth import Credentials
from services.common.client import create_channel, wait_ready
from services.common.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    StageServeError,
    UnavailableError,
)
from services.common.grpc_errors import error_from_rpc, handle_errors
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.server import (
    REQUEST_ID_KEY,
    HealthState,
    RpcMetrics,
    create_server,
    current_request_id,
    serve_until_signal,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT_S = 10.0  # generous per-call bound: a hang fails the test instead of stalling it


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Fails on request ids that name a failure; records the request ids it saw."""

    def __init__(self) -> None:
        self.seen_request_ids: list[str] = []
        self.seen_trace_ids: list[str] = []  # of the current span context in Abort ("" when none)

    @handle_errors
    async def Stats(self, request: Any, context: Any) -> decode_pb2.StatsResponse:
        return decode_pb2.StatsResponse(page_size=16, num_total_pages=8, num_free_pages=8)

    @handle_errors
    async def Reserve(self, request: Any, context: Any) -> decode_pb2.ReserveResponse:
        if request.request_id == "invalid":
            raise InvalidRequestError("prompt is empty", param="prompt_token_ids")
        if request.request_id == "capacity":
            raise CapacityError("need 4 KV pages, only 1 of 8 free")
        if request.request_id == "crash":
            raise RuntimeError("bookkeeping bug")
        return decode_pb2.ReserveResponse(kv_ref=common_pb2.KvRef(page_ids=[0, 1], page_size=16))

    @handle_errors
    async def Stream(
        self, requests: Any, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
        request = (await anext(aiter(requests))).generate
        for token_id in (5, 6, 7):
            yield decode_pb2.DecodeStreamResponse(
                request_ids=[request.request_id], token_ids=[token_id]
            )
        if request.request_id == "peer-lost":
            raise UnavailableError("prefill went away")
        if request.request_id == "crash":
            raise KeyError("slot")
        if request.request_id == "slow":
            await asyncio.sleep(60)
        end = decode_pb2.RequestEnd(
            request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH
        )
        yield decode_pb2.DecodeStreamResponse(ends=[end])

    @handle_errors
    async def Abort(self, request: Any, context: Any) -> decode_pb2.AbortResponse:
        self.seen_request_ids.append(current_request_id.get())
        span_context = trace.get_current_span().get_span_context()
        trace_id = trace.format_trace_id(span_context.trace_id) if span_context.is_valid else ""
        self.seen_trace_ids.append(trace_id)
        return decode_pb2.AbortResponse(is_found=False)


def generate(request_id: str = "") -> list[decode_pb2.DecodeStreamRequest]:
    """The one message of a Stream call that starts ``request_id``."""
    return [
        decode_pb2.DecodeStreamRequest(
            generate=decode_pb2.DecodeGenerateRequest(request_id=request_id)
        )
    ]


@dataclass
class Served:
    server: grpc.aio.Server
    port: int
    health: HealthState
    metrics: RpcMetrics
    servicer: FakeDecode
    channel: grpc.aio.Channel

    @property
    def decode(self) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel)

    async def health_status(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        return reply.status


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    health, metrics, servicer = HealthState(), RpcMetrics(), FakeDecode()
    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)],
        service_names=[DECODE],
        health=health,
        metrics=metrics,
    )
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        yield Served(server, port, health, metrics, servicer, channel)
    finally:
        await channel.close()
        await server.stop(None)


async def _rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_binds_a_real_port(served: Served) -> None:
    assert served.port > 0
    reply = await served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S)
    assert (reply.page_size, reply.num_free_pages) == (16, 8)


async def test_health_not_serving_until_ready(served: Served) -> None:
    assert await served.health_status() == NOT_SERVING
    assert await served.health_status(DECODE) == NOT_SERVING
    with pytest.raises(DeadlineExceededError, match="NOT_SERVING"):
        await wait_ready(served.channel, 0.3)
    served.health.set_serving(True)
    assert await served.health_status() == SERVING
    assert await served.health_status(DECODE) == SERVING
    await wait_ready(served.channel, TIMEOUT_S, service=DECODE)
    stub = health_pb2_grpc.HealthStub(served.channel)
    error = await _rpc_error(
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=TIMEOUT_S)
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFoundError):
        await wait_ready(served.channel, TIMEOUT_S, service="nope")


async def test_wait_ready_on_unreachable_peer_raises_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(UnavailableError):
            await wait_ready(channel, 0.5)
    finally:
        await channel.close()


async def _list_services(channel: grpc.aio.Channel) -> set[str]:
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=TIMEOUT_S)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    return {s.name for s in reply.list_services_response.service}


async def test_reflection_is_off_by_default(served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _list_services(served.channel)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("with_auth", [False, True])
async def test_reflection_lists_services_when_enabled(with_auth: bool) -> None:
    auth = Credentials("reflection-test-token") if with_auth else None
    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode())],
        service_names=[DECODE],
        health=HealthState(),
        auth=auth,
        enable_reflection=True,
    )
    await server.start()
    anonymous, channel = (
        create_channel(f"127.0.0.1:{port}"),
        create_channel(f"127.0.0.1:{port}", auth=auth),
    )
    try:
        names = await _list_services(channel)
        assert {
            DECODE,
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names
        if with_auth:  # reflection is no health check: it needs the token too
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _list_services(anonymous)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await anonymous.close()
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize(
    ("request_id", "code", "message"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        ("capacity", grpc.StatusCode.RESOURCE_EXHAUSTED, "need 4 KV pages, only 1 of 8 free"),
        ("crash", grpc.StatusCode.INTERNAL, "internal error in FakeDecode.Reserve"),
    ],
)
async def test_unary_errors_map_to_status(
    served: Served, request_id: str, code: Any, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    call = served.decode.Reserve(
        decode_pb2.ReserveRequest(request_id=request_id), timeout=TIMEOUT_S
    )
    error = await _rpc_error(call)
    assert error.code() == code
    assert message in error.details()
    logged = [r for r in caplog.records if r.exc_info and "FakeDecode.Reserve" in r.getMessage()]
    assert len(logged) == (
        1 if code == grpc.StatusCode.INTERNAL else 0
    )  # tracebacks only for the unexpected
    reply = await served.decode.Reserve(
        decode_pb2.ReserveRequest(request_id="ok"), timeout=TIMEOUT_S
    )
    assert list(reply.kv_ref.page_ids) == [0, 1]  # the server keeps answering


@pytest.mark.parametrize(
    ("request_id", "code"),
    [("peer-lost", grpc.StatusCode.UNAVAILABLE), ("crash", grpc.StatusCode.INTERNAL)],
)
async def test_stream_error_ends_stream_with_status(
    served: Served, request_id: str, code: Any
) -> None:
    call = served.decode.Stream(iter(generate(request_id)), timeout=TIMEOUT_S)
    token_ids: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for reply in call:
            token_ids.extend(reply.token_ids)
    assert token_ids == [5, 6, 7]
    assert info.value.code() == code
    replies = [r async for r in served.decode.Stream(iter(generate()), timeout=TIMEOUT_S)]
    assert replies[-1].ends[0].finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("request_id", "cls", "param"),
    [
        ("invalid", InvalidRequestError, "prompt_token_ids"),
        ("capacity", CapacityError, None),
        ("crash", StageServeError, None),
    ],
)
async def test_client_gets_typed_errors(
    served: Served, request_id: str, cls: type, param: str | None
) -> None:
    error = error_from_rpc(
        await _rpc_error(served.decode.Reserve(decode_pb2.ReserveRequest(request_id=request_id)))
    )
    assert type(error) is cls
    assert error.param == param
    assert error.retryable == cls.retryable


async def test_client_maps_transport_codes(served: Served) -> None:
    call = served.decode.Stream(iter(generate("slow")), timeout=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert isinstance(error_from_rpc(info.value), DeadlineExceededError)
    await served.server.stop(None)
    error = await _rpc_error(served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S))
    assert isinstance(error_from_rpc(error), UnavailableError)


async def test_metrics_count_rpcs_by_status(served: Served) -> None:
    await served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S)
    await _rpc_error(
        served.decode.Reserve(decode_pb2.ReserveRequest(request_id="capacity"), timeout=TIMEOUT_S)
    )
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in served.decode.Stream(iter(generate("peer-lost"))):
            pass
    metrics = served.metrics
    assert metrics.num_calls("/stageserve.v1.Decode/Stats", "OK") == 1
    assert metrics.num_calls("/stageserve.v1.Decode/Reserve", "RESOURCE_EXHAUSTED") == 1
    assert metrics.num_calls("/stageserve.v1.Decode/Stream", "UNAVAILABLE") == 1
    assert all(s.total_s >= 0.0 for s in metrics.snapshot().values())


async def test_request_id_is_bound_and_forwarded(served: Served) -> None:
    await served.decode.Abort(
        decode_pb2.AbortRequest(), metadata=((REQUEST_ID_KEY, "req-1"),), timeout=TIMEOUT_S
    )
    token = current_request_id.set("req-2")  # as inside a handler: the client forwards it
    try:
        await served.decode.Abort(decode_pb2.AbortRequest(), timeout=TIMEOUT_S)
    finally:
        current_request_id.reset(token)
    await served.decode.Abort(decode_pb2.AbortRequest(), timeout=TIMEOUT_S)
    first, second, fresh = served.servicer.seen_request_ids
    assert (first, second) == ("req-1", "req-2")
    assert len(fresh) == 32  # made up by the server when the caller sent none


async def test_the_callers_trace_context_is_current_in_the_handler(served: Served) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)
    await served.decode.Abort(decode_pb2.AbortRequest(), metadata=metadata, timeout=TIMEOUT_S)
    await served.decode.Abort(decode_pb2.AbortRequest(), timeout=TIMEOUT_S)
    assert served.servicer.seen_trace_ids == [trace_id, ""]  # so the handler's log lines carry it


def test_rpc_metrics_are_exported_to_prometheus() -> None:
    from prometheus_client import REGISTRY

    labels = {"grpc_service": "stageserve.v1.Test", "grpc_method": "Ping"}
    before = (
        REGISTRY.get_sample_value("stageserve_grpc_server_handling_seconds_count", labels) or 0.0
    )
    RpcMetrics().record("/stageserve.v1.Test/Ping", "DEADLINE_EXCEEDED", 0.5)
    handled = REGISTRY.get_sample_value(
        "stageserve_grpc_server_handled_total", {**labels, "grpc_code": "DEADLINE_EXCEEDED"}
    )
    assert handled is not None and handled >= 1
    assert (
        REGISTRY.get_sample_value("stageserve_grpc_server_handling_seconds_count", labels)
        == before + 1
    )


async def test_graceful_shutdown_order(served: Served) -> None:
    served.health.set_serving(True)
    watch = health_pb2_grpc.HealthStub(served.channel).Watch(
        health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S
    )
    assert (await watch.read()).status == SERVING
    released: list[bool] = []  # whether health was already NOT_SERVING when release ran
    stop = asyncio.Event()
    serving = asyncio.create_task(
        serve_until_signal(
            served.server,
            served.health,
            lambda: released.append(served.health.is_serving),
            grace_s=1.0,
            stop=stop,
        )
    )
    stop.set()
    assert (await watch.read()).status == NOT_SERVING
    await asyncio.wait_for(serving, TIMEOUT_S)
    assert released == [False]  # ran exactly once, after NOT_SERVING
    served.health.set_serving(True)
    assert not served.health.is_serving  # shutdown is final
    error = await _rpc_error(served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


SERVER_SCRIPT = """
import asyncio
from services.common.server import HealthState, create_server, serve_until_signal

async def main():
    health = HealthState()
    server, port = create_server([], health=health)
    await server.start()
    health.set_serving(True)
    print(port, flush=True)
    await serve_until_signal(server, health, lambda: print("released", flush=True), grace_s=1.0)

asyncio.run(main())
"""


async def test_sigterm_stops_the_process_cleanly() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER_SCRIPT,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
        channel = create_channel(f"127.0.0.1:{port}")
        try:
            await wait_ready(channel, TIMEOUT_S)
        finally:
            await channel.close()
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert out.decode().split() == ["released"]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
