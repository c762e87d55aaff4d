from __future__ import annotations

import asyncio
import sys

from grpc_health.v1 import health_pb2

from services.common.healthcheck import main
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
