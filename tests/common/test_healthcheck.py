from __future__ import annotations

import asyncio
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.healthcheck import HealthAnswer, check, check_async, main
from services.common.server import HealthState, create_server
from tests.conftest import INTERNAL_AUTH, REPO


async def run(cmd: list[str]) -> int:
    # a child process, so this event loop keeps serving the health checks it sends
    process = await asyncio.create_subprocess_exec(*cmd, cwd=REPO)
    return await asyncio.wait_for(process.wait(), timeout=60)


async def test_healthcheck_follows_readiness(tmp_path):
    health = HealthState()
    server, port = create_server(
        [], port=0, service_names=["stageserve.v1.Decode"], health=health, auth=INTERNAL_AUTH
    )
    await server.start()
    token_file = tmp_path / "token"
    token_file.write_text(INTERNAL_AUTH.token + "\n")
    try:
        cmd = [sys.executable, "-m", "services.common.healthcheck", f"127.0.0.1:{port}"]
        assert await run(cmd) == 1
        health.set_serving(True)
        assert await run(cmd) == 0  # health needs no token
        assert await run([*cmd, "stageserve.v1.Decode", "--token-file", str(token_file)]) == 0
        assert health.status("") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    assert main(["127.0.0.1:1"]) == 1
    assert main([]) == 2
    assert main(["127.0.0.1:1", "--token-file", str(tmp_path / "missing")]) == 2


async def test_check_async_reads_each_answer_as_the_blocking_check_does():
    health = HealthState()
    server, port = create_server([], port=0, service_names=["stageserve.v1.Decode"], health=health)
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await check_async(stub, timeout_s=5)
            assert (answer.is_serving, answer.why_not_serving) == (False, "NOT_SERVING")
            health.set_serving(True)
            assert (await check_async(stub, timeout_s=5)).why_not_serving is None
            missing = await check_async(stub, service="nope", timeout_s=5)
            assert missing.code == grpc.StatusCode.NOT_FOUND and missing.status is None
            assert missing.why_not_serving.startswith("NOT_FOUND: ")
        with grpc.insecure_channel(address) as channel:
            blocking = await asyncio.to_thread(check, channel, service="nope", timeout_s=5)
        assert blocking == missing
    finally:
        await server.stop(0)
    answer = HealthAnswer.of_error(_Unreachable())
    assert answer.why_not_serving == "UNAVAILABLE: connection refused"


class _Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"
