"""What crosses a service boundary in a failed call: typed errors, and no internal details."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import grpc
import pytest

from services.common.client import create_channel
from services.common.errors import (
    MAX_MESSAGE_CHARS,
    MAX_PARAM_CHARS,
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
    clip,
)
from services.common.grpc_errors import error_from_rpc, handle_errors
from services.common.pb.stageserve.v1 import decode_pb2, decode_pb2_grpc
from services.common.server import HealthState, create_server

TIMEOUT_S = 10.0  # a hang fails the test instead of stalling it
SECRET = "bookkeeping of 0x7f438441f5b0 at 10.1.2.3:4567"


class LeakyDecode(decode_pb2_grpc.DecodeServicer):
    @handle_errors
    async def Stats(self, request: Any, context: Any) -> decode_pb2.StatsResponse:
        raise RuntimeError(SECRET)

    @handle_errors
    async def Reserve(self, request: Any, context: Any) -> decode_pb2.ReserveResponse:
        raise InvalidRequestError("prompt is empty", param="prompt_token_ids")

    @handle_errors
    async def Abort(self, request: Any, context: Any) -> decode_pb2.AbortResponse:
        await asyncio.sleep(TIMEOUT_S)  # past the caller's deadline
        return decode_pb2.AbortResponse()


@pytest.fixture
async def stub():
    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, LeakyDecode())], 0, health=HealthState()
    )
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        yield decode_pb2_grpc.DecodeStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_transport_failure_names_the_service_not_the_address(caplog):
    channel = create_channel(f"127.0.0.1:{closed_port()}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await decode_pb2_grpc.DecodeStub(channel).Stats(
                decode_pb2.StatsRequest(), timeout=TIMEOUT_S
            )
    finally:
        await channel.close()
    assert "127.0.0.1" in info.value.details()  # what gRPC says, and what must not reach a client
    with caplog.at_level(logging.INFO, logger="services.common.grpc_errors"):
        error = error_from_rpc(info.value, service="decode")
    assert type(error) is UnavailableError
    assert error.message == "the decode service is unavailable"
    assert "127.0.0.1" in caplog.text  # the details are logged
    assert error_from_rpc(info.value).message == "a backend service is unavailable"


async def test_own_deadline_is_a_generic_deadline_error(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(decode_pb2.AbortRequest(), timeout=0.2)
    error = error_from_rpc(info.value, service="decode")
    assert type(error) is DeadlineExceededError
    assert error.message == "the decode service did not answer before the deadline"


async def test_unexpected_exception_text_stays_in_the_log(stub, caplog):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert SECRET not in info.value.details() and "RuntimeError" not in info.value.details()
    assert (
        info.value.details()
        == "internal error in LeakyDecode.Stats (the service log has the details)"
    )
    assert SECRET in caplog.text  # with the traceback
    error = error_from_rpc(info.value, service="decode")
    assert type(error) is StageServeError and error.message == info.value.details()


async def test_typed_errors_keep_message_and_param(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Reserve(decode_pb2.ReserveRequest(), timeout=TIMEOUT_S)
    error = error_from_rpc(info.value, service="decode")
    assert type(error) is InvalidRequestError
    assert (error.message, error.param) == ("prompt is empty", "prompt_token_ids")


async def test_refused_internal_credentials_are_a_deployment_error_not_the_callers() -> None:
    """A peer answering UNAUTHENTICATED refused *our* token: never a 401 for the end client."""
    from services.common.auth import Credentials
    from services.common.errors import CredentialsRefusedError

    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, LeakyDecode())],
        0,
        health=HealthState(),
        auth=Credentials("the-right-token"),
    )
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}", auth=Credentials("a-wrong-token"))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await decode_pb2_grpc.DecodeStub(channel).Stats(
                decode_pb2.StatsRequest(), timeout=TIMEOUT_S
            )
        error = error_from_rpc(info.value, service="decode")
        assert type(error) is CredentialsRefusedError and error.http_status == 500
        assert error.message == (
            "the decode service refused this service's internal credentials (check "
            "STAGESERVE_INTERNAL_TOKEN)"
        )
    finally:
        await channel.close()
        await server.stop(None)


async def test_an_overloaded_peer_stays_overloaded_across_the_hop() -> None:
    """OverloadedError keeps its class over gRPC, so the router answers 429 with Retry-After."""
    from services.common.errors import OverloadedError

    class Busy(decode_pb2_grpc.DecodeServicer):
        @handle_errors
        async def Stats(self, request: Any, context: Any) -> decode_pb2.StatsResponse:
            raise OverloadedError("the decode is busy")

    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, Busy())], 0, health=HealthState()
    )
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await decode_pb2_grpc.DecodeStub(channel).Stats(
                decode_pb2.StatsRequest(), timeout=TIMEOUT_S
            )
        error = error_from_rpc(info.value, service="decode")
        assert (
            type(error) is OverloadedError and error.http_status == 429 and error.retry_after_s > 0
        )
        assert error.message == "the decode is busy"
    finally:
        await channel.close()
        await server.stop(None)


class EchoingDecode(decode_pb2_grpc.DecodeServicer):
    @handle_errors
    async def Reserve(self, request: Any, context: Any) -> decode_pb2.ReserveResponse:
        echoed = "x" * 1_000_000  # a client string the error names
        raise InvalidRequestError(f"{echoed} is not a known name", param=echoed)


async def test_long_messages_and_params_are_clipped_on_the_wire() -> None:
    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, EchoingDecode())], 0, health=HealthState()
    )
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await decode_pb2_grpc.DecodeStub(channel).Reserve(
                decode_pb2.ReserveRequest(), timeout=TIMEOUT_S
            )
    finally:
        await channel.close()
        await server.stop(None)
    error = error_from_rpc(info.value, service="decode")
    assert type(error) is InvalidRequestError
    assert len(error.message) <= MAX_MESSAGE_CHARS + 50 and len(error.param) <= MAX_PARAM_CHARS + 50
    assert error.message.endswith(" is not a known name")  # the explanation is kept
    assert "...[1000020 characters, cut]..." in error.message
    assert "...[1000000 characters, cut]..." in error.param


@pytest.mark.parametrize(
    ("text", "limit", "clipped"),
    [
        ("short", 10, "short"),
        ("x" * 10, 10, "x" * 10),
        ("a" * 20 + "b" * 20, 9, "aaaaaa...[40 characters, cut]...bbb"),
    ],
)
def test_clip(text, limit, clipped) -> None:
    assert clip(text, limit) == clipped
