"""Internal gRPC authentication: the token, the server interceptor, the client side, ``up``'s
env."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import (
    API_KEY,
    AuthConfigError,
    Credentials,
    child_environment,
    internal_credentials,
)
from services.common.client import create_channel
from services.common.envs import Envs
from services.common.pb.stageserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    vision_encoder_pb2,
    vision_encoder_pb2_grpc,
)
from services.common.server import (
    REQUEST_ID_KEY,
    HealthState,
    RpcMetrics,
    create_server,
    current_request_id,
)
from services.decode.servicer import DecodeServicer
from services.prefill.image_store import ImageStore
from services.prefill.kv_refs import KvRefVerifier
from services.prefill.servicer import PrefillServicer

TOKEN = Credentials("s3cret-token_for-tests")
WRONG = Credentials("not-the-token")
TIMEOUT_S = 10.0  # generous per-call bound: a hang fails the test instead of stalling it
DENIED = "missing or invalid internal credentials"


@dataclass(frozen=True)
class Kind:
    """One service kind: its generated registration, a servicer, its proto descriptor."""

    name: str
    add_to_server: Any
    make_servicer: Any
    descriptor: Any


# Decode and prefill run their real servicers (not attached to an engine: an accepted call
# reaches them and gets UNAVAILABLE); the others their generated method table (UNIMPLEMENTED).
KINDS = [
    Kind(
        "decode",
        decode_pb2_grpc.add_DecodeServicer_to_server,
        lambda: DecodeServicer(60.0, 300.0, b"k"),
        decode_pb2.DESCRIPTOR.services_by_name["Decode"],
    ),
    Kind(
        "prefill",
        prefill_pb2_grpc.add_PrefillServicer_to_server,
        lambda: PrefillServicer(60.0, KvRefVerifier(b"k", 16), ImageStore(1 << 20)),
        prefill_pb2.DESCRIPTOR.services_by_name["Prefill"],
    ),
    Kind(
        "tokenizer",
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
        tokenizer_pb2_grpc.TokenizerServicer,
        tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"],
    ),
    Kind(
        "vision_encoder",
        vision_encoder_pb2_grpc.add_VisionEncoderServicer_to_server,
        vision_encoder_pb2_grpc.VisionEncoderServicer,
        vision_encoder_pb2.DESCRIPTOR.services_by_name["VisionEncoder"],
    ),
    Kind(
        "router",
        router_pb2_grpc.add_RouterServicer_to_server,
        router_pb2_grpc.RouterServicer,
        router_pb2.DESCRIPTOR.services_by_name["Router"],
    ),
]


@dataclass
class Served:
    port: int
    kind: Kind
    metrics: RpcMetrics


@pytest.fixture(params=KINDS, ids=lambda kind: kind.name)
async def served(request) -> AsyncIterator[Served]:
    kind: Kind = request.param
    health, metrics = HealthState(), RpcMetrics()
    server, port = create_server(
        [(kind.add_to_server, kind.make_servicer())],
        service_names=[kind.descriptor.full_name],
        health=health,
        metrics=metrics,
        auth=TOKEN,
    )
    await server.start()
    health.set_serving(True)
    try:
        yield Served(port, kind, metrics)
    finally:
        await server.stop(None)


async def call_method(
    channel: grpc.aio.Channel, service: str, method: Any, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    """Call ``method`` (any of the four kinds) with an empty request; return its status code."""
    path = f"/{service}/{method.name}"
    try:
        if method.client_streaming:
            multi = channel.stream_stream if method.server_streaming else channel.stream_unary
            call = multi(path)(iter([b""]), metadata=metadata, timeout=TIMEOUT_S)
        else:
            multi = channel.unary_stream if method.server_streaming else channel.unary_unary
            call = multi(path)(b"", metadata=metadata, timeout=TIMEOUT_S)
        if method.server_streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            assert exc.details() == DENIED
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("auth", [None, WRONG], ids=["no-token", "wrong-token"])
async def test_every_method_requires_the_token(served: Served, auth: Credentials | None) -> None:
    service = served.kind.descriptor
    channel = create_channel(f"127.0.0.1:{served.port}", auth=auth)
    try:
        for method in service.methods:
            assert (
                await call_method(channel, service.full_name, method)
                == grpc.StatusCode.UNAUTHENTICATED
            )
    finally:
        await channel.close()
    paths = [f"/{service.full_name}/{method.name}" for method in service.methods]
    async with asyncio.timeout(
        TIMEOUT_S
    ):  # the server records a call just after its status is sent
        while any(served.metrics.num_calls(path, "UNAUTHENTICATED") != 1 for path in paths):
            await asyncio.sleep(0.01)


async def test_the_token_lets_every_method_through(served: Served) -> None:
    service = served.kind.descriptor
    channel = create_channel(f"127.0.0.1:{served.port}", auth=TOKEN)
    try:
        for method in service.methods:
            code = await call_method(channel, service.full_name, method)
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED), (
                method.name,
                code,
            )
    finally:
        await channel.close()


async def test_exactly_one_authorization_value_is_accepted(served: Served) -> None:
    service = served.kind.descriptor
    channel = create_channel(f"127.0.0.1:{served.port}")
    try:
        for times in (1, 2):
            metadata = (("authorization", TOKEN.header_value),) * times
            code = await call_method(channel, service.full_name, service.methods[0], metadata)
            assert (code == grpc.StatusCode.UNAUTHENTICATED) == (times == 2), times
    finally:
        await channel.close()


async def test_health_needs_no_token(served: Served) -> None:
    channel = create_channel(f"127.0.0.1:{served.port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", served.kind.descriptor.full_name):
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    finally:
        await channel.close()


async def test_unknown_method_is_unimplemented_with_or_without_token(served: Served) -> None:
    for auth in (None, TOKEN):
        channel = create_channel(f"127.0.0.1:{served.port}", auth=auth)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/stageserve.v1.Nope/Missing")(b"", timeout=TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await channel.close()


async def test_channel_sends_token_and_request_id_on_all_four_call_kinds() -> None:
    seen: dict[str, dict[str, str]] = {}

    def record(kind: str) -> Any:
        def metadata_of(context: Any) -> dict[str, str]:
            return {k: v for k, v in context.invocation_metadata()}

        if kind.endswith("_stream"):

            async def streaming(request: Any, context: Any) -> AsyncIterator[bytes]:
                seen[kind] = metadata_of(context)
                yield b"ok"

            return streaming

        async def unary(request: Any, context: Any) -> bytes:
            seen[kind] = metadata_of(context)
            return b"ok"

        return unary

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    handlers = {kind: getattr(grpc, f"{kind}_rpc_method_handler")(record(kind)) for kind in kinds}
    generic = grpc.method_handlers_generic_handler("test.Kinds", handlers)
    register = (lambda _servicer, srv: srv.add_generic_rpc_handlers((generic,)), None)
    server, port = create_server([register], health=HealthState(), auth=TOKEN)
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}", auth=TOKEN)
    request_id = current_request_id.set("req-7")  # as inside a handler: forwarded on every kind
    try:
        assert await channel.unary_unary("/test.Kinds/unary_unary")(b"", timeout=TIMEOUT_S) == b"ok"
        assert [
            r
            async for r in channel.unary_stream("/test.Kinds/unary_stream")(b"", timeout=TIMEOUT_S)
        ]
        stream_unary = channel.stream_unary("/test.Kinds/stream_unary")
        assert await stream_unary(iter([b""]), timeout=TIMEOUT_S) == b"ok"
        call = channel.stream_stream("/test.Kinds/stream_stream")(timeout=TIMEOUT_S)
        await call.write(b"")  # the write()/read() style of decode's Stream
        assert await call.read() == b"ok"
        await call.done_writing()
    finally:
        current_request_id.reset(request_id)
        await channel.close()
        await server.stop(None)
    assert sorted(seen) == sorted(kinds)
    for kind, metadata in seen.items():
        assert metadata["authorization"] == TOKEN.header_value, kind
        assert metadata[REQUEST_ID_KEY] == "req-7", kind


def test_credentials_accept_only_the_bearer_token() -> None:
    assert TOKEN.accepts("Bearer s3cret-token_for-tests")
    assert TOKEN.accepts(b"bearer s3cret-token_for-tests")  # the scheme is case-insensitive
    refused = (
        None,
        "",
        "Bearer",
        "Bearer ",
        "s3cret-token_for-tests",
        "Basic s3cret-token_for-tests",
        "Bearer s3cret-token_for-test",
        "Bearer s3cret-token_for-testsX",
        "Bearer  s3cret-token_for-tests",
    )
    for value in refused:
        assert not TOKEN.accepts(value), value
    assert "s3cret" not in repr(TOKEN)
    assert "s3cret" not in repr(Envs(internal_token="s3cret", api_key="s3cret"))
    assert TOKEN.denied_message == DENIED
    assert Credentials("k", API_KEY).denied_message == "missing or invalid API key"


@pytest.mark.parametrize("token", ["", "has space", "tab\t", "caf\u00e9"])
def test_a_token_that_is_no_header_value_is_refused(token: str) -> None:
    with pytest.raises(AuthConfigError):
        Credentials(token)


def test_token_file_wins_over_the_environment_and_is_stripped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  from-file\n")
    envs = Envs.from_environ({"STAGESERVE_INTERNAL_TOKEN": "from-env"})
    assert internal_credentials(envs, path, allow_unauthenticated=False) == Credentials("from-file")
    assert internal_credentials(envs, None, allow_unauthenticated=False) == Credentials("from-env")


@pytest.mark.parametrize("content", [None, "", " \n"], ids=["missing", "empty", "blank"])
def test_unusable_token_file_is_an_error(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    envs = Envs.from_environ({"STAGESERVE_INTERNAL_TOKEN": "from-env"})
    with pytest.raises(AuthConfigError, match=str(path)):
        internal_credentials(envs, path, allow_unauthenticated=True)


def test_no_token_is_refused_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    envs = Envs.from_environ({})
    with pytest.raises(AuthConfigError, match="STAGESERVE_INTERNAL_TOKEN.*--internal-token-file"):
        internal_credentials(envs, None, allow_unauthenticated=False)
    with caplog.at_level(logging.WARNING, logger="services.common.auth"):
        assert internal_credentials(envs, None, allow_unauthenticated=True) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--allow-unauthenticated" in warnings[0].getMessage()


def test_up_children_get_a_fresh_token_through_the_environment() -> None:
    parent = {"PATH": "/usr/bin"}
    first, second = child_environment(parent), child_environment(parent)
    assert parent == {"PATH": "/usr/bin"}  # not modified
    assert first["PATH"] == "/usr/bin" and "STAGESERVE_API_KEY" not in first
    token = first["STAGESERVE_INTERNAL_TOKEN"]
    assert len(token) >= 43 and token != second["STAGESERVE_INTERNAL_TOKEN"]  # 32 random bytes
    Credentials(token)  # usable as a header value


def test_up_keeps_the_callers_token_and_passes_the_api_key() -> None:
    env = child_environment({"STAGESERVE_INTERNAL_TOKEN": "mine"}, api_key="key-1")
    assert env["STAGESERVE_INTERNAL_TOKEN"] == "mine" and env["STAGESERVE_API_KEY"] == "key-1"
    with pytest.raises(AuthConfigError, match="API key"):
        child_environment({}, api_key="two words")
