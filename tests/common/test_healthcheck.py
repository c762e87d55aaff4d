from __future__ import annotations

import asyncio
import sys

from grpc_health.v1 import health_pb2

from services.common.healthcheck import main
from services.common.server import HealthState, create_server
from tests.conftest import REPO


async def run(cmd: list[str]) -> int:
    # a child process, so this event loop keeps serving the health checks it sends
    process = await asyncio.create_subprocess_exec(*cmd, cwd=REPO)
    return await asyncio.wait_for(process.wait(), timeout=60)


async def test_healthcheck_follows_readiness():
    health = HealthState()
    server, port = create_server([], port=0, service_names=["stageserve.v1.Decode"], health=health)
    await server.start()
    try:
        cmd = [sys.executable, "-m", "services.common.healthcheck", f"127.0.0.1:{port}"]
        assert await run(cmd) == 1
        health.set_serving(True)
        assert await run(cmd) == 0
        assert health.status("") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    assert main(["127.0.0.1:1"]) == 1
    assert main([]) == 2
