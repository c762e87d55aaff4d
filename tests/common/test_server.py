"""The shared gRPC skeleton: health, reflection (off unless enabled) and error mapping."""

from __future__ import annotations

import socket
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

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
from services.common.grpc_errors import error_from_rpc
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.server import (
    HealthState,
    create_server,
)
from tests.common.server_helpers import (
    DECODE,
    NOT_SERVING,
    SERVING,
    TIMEOUT_S,
    FakeDecode,
    Served,
    _rpc_error,
    generate,
)


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


async def test_client_maps_transport_codes(served: Served) -> None:
    call = served.decode.Stream(iter(generate("slow")), timeout=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert isinstance(error_from_rpc(info.value), DeadlineExceededError)
    await served.server.stop(None)
    error = await _rpc_error(served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S))
    assert isinstance(error_from_rpc(error), UnavailableError)
