"""The router's API key (HTTP ``/v1/*`` and gRPC ``Router``) and its internal token to the
workers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import API_KEY, Credentials
from services.common.client import create_channel
from services.common.envs import Envs
from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.__main__ import access_from_args, build_parser
from services.router.app import RouterApp
from services.router.auth import RouterAccess
from tests.conftest import INTERNAL_AUTH
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    Cluster,
    asgi_client,
    router_config,
    start_router,
    stop_router,
    wait_until,
)

API = Credentials("sk-test-key", API_KEY)
INTERNAL = INTERNAL_AUTH  # what secured_cluster's workers require
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
UNAUTHORIZED_BODY = {
    "error": {
        "message": "missing or invalid API key",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


@pytest.fixture
async def secured_router(secured_cluster: Cluster) -> AsyncIterator[RouterApp]:
    app = await start_router(router_config(secured_cluster), access=RouterAccess(INTERNAL, API))
    yield app
    await stop_router(app)


@pytest.fixture
async def http(secured_router: RouterApp) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(secured_router) as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("sk-wrong"),
        {"Authorization": "sk-test-key"},
        {"Authorization": "Basic sk-test-key"},
        bearer(INTERNAL.token),
    ],  # the internal token is no API key
    ids=["none", "wrong", "no-scheme", "basic", "internal-token"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/unknown"),
        ("GET", "/metrics"),
    ],
)
async def test_api_without_the_key_gets_401(http, secured_cluster, headers, method, path) -> None:
    reply = await http.request(
        method, path, headers=headers, json=CHAT if method == "POST" else None
    )
    assert reply.status_code == 401
    assert reply.json() == UNAUTHORIZED_BODY
    assert reply.headers["www-authenticate"] == "Bearer"
    assert secured_cluster.prefill.requests == []  # nothing reached a worker


async def test_two_authorization_headers_are_refused(http) -> None:
    headers = [("authorization", API.header_value), ("authorization", "Bearer sk-wrong")]
    reply = await http.get("/v1/models", headers=headers)
    assert reply.status_code == 401 and reply.json() == UNAUTHORIZED_BODY


async def test_api_with_the_key_serves_and_health_stays_open(http, secured_cluster) -> None:
    models = await http.get("/v1/models", headers=bearer(API.token))
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_NAME
    lower_case = {"authorization": "bearer sk-test-key"}
    reply = await http.post("/v1/chat/completions", json=CHAT, headers=lower_case)
    assert reply.status_code == 200, reply.text  # the workers accepted the router's internal token
    assert reply.json()["choices"][0]["message"]["content"]
    health = await http.get("/health")  # no key: probes stay open
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize(
    "headers", [{}, bearer("sk-wrong"), bearer(INTERNAL.token)], ids=["none", "wrong", "internal"]
)
@pytest.mark.parametrize("path", ["/health", "/health?x=1"])
async def test_health_without_the_key_tells_only_the_status(
    http, secured_router, secured_cluster, headers, path
) -> None:
    health = await http.get(path, headers=headers)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    await secured_cluster.decodes[0].server.stop(None)
    await wait_until(lambda: not secured_router.registry.is_ready)
    down = await http.get(path, headers=headers)
    assert down.status_code == 503 and down.json() == {"status": "unavailable"}


async def test_health_with_the_key_details_workers_and_admission(
    http, secured_router, secured_cluster
) -> None:
    health = await http.get("/health", headers=bearer(API.token))
    body = health.json()
    assert health.status_code == 200 and body["status"] == "ok" and "admission" in body
    addresses = {w["address"] for w in body["workers"]}
    assert secured_cluster.tokenizer.address in addresses
    await secured_cluster.decodes[0].server.stop(None)
    await wait_until(lambda: not secured_router.registry.is_ready)
    down = await http.get("/health", headers=bearer(API.token))
    assert down.status_code == 503 and down.json()["missing"] == ["decode"]


def generate_request() -> router_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user")
    message.content.add(text="hello")
    return router_pb2.GenerateRequest(
        request_id="req-1",
        chat=common_pb2.ChatMessages(messages=[message]),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=20),
    )


@pytest.mark.parametrize(
    "auth", [None, Credentials("sk-wrong", API_KEY), INTERNAL], ids=["none", "wrong", "internal"]
)
async def test_grpc_generate_without_the_key_is_unauthenticated(
    secured_router, secured_cluster, auth
) -> None:
    channel = create_channel(f"127.0.0.1:{secured_router.grpc_port}", auth=auth)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in router_pb2_grpc.RouterStub(channel).Generate(
                generate_request(), timeout=BOUND_S
            ):
                pass
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=BOUND_S
        )
    finally:
        await channel.close()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == "missing or invalid API key"
    assert reply.status == health_pb2.HealthCheckResponse.SERVING  # health needs no key
    assert secured_cluster.prefill.requests == []


async def test_grpc_generate_with_the_key_streams(secured_router) -> None:
    channel = create_channel(f"127.0.0.1:{secured_router.grpc_port}", auth=API)
    try:
        responses = [
            r
            async for r in router_pb2_grpc.RouterStub(channel).Generate(
                generate_request(), timeout=BOUND_S
            )
        ]
    finally:
        await channel.close()
    assert "".join(r.text_delta for r in responses)
    assert responses[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


async def test_router_without_the_internal_token_is_refused_by_the_workers(secured_cluster) -> None:
    app = await start_router(router_config(secured_cluster))  # no internal token, open API
    try:
        async with asgi_client(app) as http:
            reply = await http.post("/v1/chat/completions", json=CHAT)
    finally:
        await stop_router(app)
    assert reply.status_code >= 400
    assert secured_cluster.prefill.requests == []


def access_of(argv: list[str], environ: dict[str, str]) -> RouterAccess:
    envs = Envs.from_environ(environ)
    return access_from_args(build_parser(envs).parse_args(argv), envs)


def test_api_key_flag_defaults_to_the_environment() -> None:
    token = {"STAGESERVE_INTERNAL_TOKEN": "t0ken"}
    assert access_of([], token) == RouterAccess(Credentials("t0ken"), None, False)
    from_env = access_of([], {**token, "STAGESERVE_API_KEY": "sk-env"})
    assert from_env.api_key == Credentials("sk-env", API_KEY)
    from_flag = access_of(
        ["--api-key", "sk-flag", "--enable-reflection"], {**token, "STAGESERVE_API_KEY": "sk-env"}
    )
    assert from_flag == RouterAccess(Credentials("t0ken"), Credentials("sk-flag", API_KEY), True)


def test_router_refuses_an_unusable_key_or_no_internal_token() -> None:
    with pytest.raises(
        SystemExit, match="router: error: --api-key / STAGESERVE_API_KEY: .*printable ASCII"
    ):
        access_of(["--api-key", "two words"], {"STAGESERVE_INTERNAL_TOKEN": "t0ken"})
    with pytest.raises(SystemExit, match="router: error: no internal token"):
        access_of([], {})
    assert access_of(["--allow-unauthenticated"], {}).internal is None


@pytest.mark.parametrize(
    "hosts",
    [
        ["--host", "0.0.0.0"],
        ["--http-host", "::"],
        ["--host", "10.1.2.3", "--http-host", "127.0.0.1"],
        ["--http-host", "router.example"],
    ],
)
def test_router_refuses_a_non_loopback_address_without_a_key(hosts) -> None:
    token = {"STAGESERVE_INTERNAL_TOKEN": "t0ken"}
    with pytest.raises(SystemExit) as info:
        access_of(hosts, token)
    message = str(info.value.code)
    assert message.startswith("router: error: the API would listen on ")
    assert "--api-key or STAGESERVE_API_KEY" in message and "--insecure-no-api-key" in message
    with_key = access_of(hosts, {**token, "STAGESERVE_API_KEY": "sk-env"})
    assert with_key.api_key == Credentials("sk-env", API_KEY)
    assert access_of([*hosts, "--insecure-no-api-key"], token).api_key is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_router_serves_loopback_without_a_key(host) -> None:
    token = {"STAGESERVE_INTERNAL_TOKEN": "t0ken"}
    assert access_of(["--host", host, "--http-host", host], token).api_key is None
