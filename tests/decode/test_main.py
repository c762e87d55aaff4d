"""``python -m services.decode`` as a process: READY line, health, graceful SIGTERM (Mooncake backend)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import signing
from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.clients.decode import DecodeClient
from services.common.errors import CredentialsRefusedError
from services.common.types import SamplingParams
from services.decode.servicer import SERVICE_NAME
from tests.conftest import REPO

READY_TIMEOUT_S = 120.0
TOKEN = "decode-main-test-token"
READY = re.compile(r"^READY decode port=(\d+) metrics_port=(\d+)$")


def read_ready_line(process: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline_mono = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline_mono:
        line = process.stdout.readline()  # the service prints nothing else on stdout
        if not line:
            pytest.fail(f"decode exited with {process.wait(5)} before READY")
        match = READY.match(line.strip())
        if match:
            return match
    pytest.fail("no READY line in time")


@pytest.mark.integration
def test_process_serves_then_stops_on_sigterm(tmp_path) -> None:
    stderr = (tmp_path / "decode.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.decode",
            "--port",
            "0",
            "--num-pages",
            "64",
            "--transfer-backend",
            "mooncake",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "STAGESERVE_INTERNAL_TOKEN": TOKEN},
    )
    try:
        port = int(read_ready_line(process, READY_TIMEOUT_S).group(1))
        asyncio.run(check_serving(f"127.0.0.1:{port}"))
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()


async def check_serving(address: str) -> None:
    channel = create_channel(address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()
    anonymous = DecodeClient(address)  # the process requires its token
    try:
        with pytest.raises(
            CredentialsRefusedError, match="refused this service's internal credentials"
        ):
            await anonymous.stats()
    finally:
        await anonymous.close()
    client = DecodeClient(address, auth=Credentials(TOKEN))
    try:
        kv_ref = await client.reserve(
            "r", [5, 6, 7], 0, SamplingParams(max_new_tokens=4), time.time() + 30
        )
        assert kv_ref.backend == "mooncake" and kv_ref.session_id and len(kv_ref.page_ids) == 1
        assert kv_ref.has_valid_mac(signing.key_of(TOKEN))  # signed with STAGESERVE_INTERNAL_TOKEN
        assert (await client.stats()).num_reserved_requests == 1
        assert await client.abort(
            "r", "test"
        )  # never written: quarantined for --kv-quarantine-s (35)
        stats = await client.stats()
        assert (stats.num_free_pages, stats.num_quarantined_pages) == (63, 1)
        await client.reserve("w", [5, 6, 7], 0, SamplingParams(max_new_tokens=4), time.time() + 30)
        assert await client.abort("w", "test", is_kv_written=True)
        assert (await client.stats()).num_free_pages == 63
    finally:
        await client.close()
