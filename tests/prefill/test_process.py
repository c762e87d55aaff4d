"""``python -m services.prefill`` as an OS process: READY line, health SERVING, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.pb.stageserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.conftest import REPO

READY_TIMEOUT_S = 120.0
pytestmark = pytest.mark.integration


def _read_ready_line(process: subprocess.Popen) -> str:
    deadline_mono = time.monotonic() + READY_TIMEOUT_S
    assert process.stdout is not None
    os.set_blocking(process.stdout.fileno(), False)
    buffered = ""
    while time.monotonic() < deadline_mono:
        chunk = process.stdout.readline()
        if chunk:
            buffered += chunk
            if buffered.endswith("\n"):
                return buffered.strip()
            continue
        if process.poll() is not None:
            raise AssertionError(f"prefill exited with {process.returncode} before READY")
        time.sleep(0.05)
    raise AssertionError("no READY line within the timeout")


async def test_ready_health_and_sigterm() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.prefill",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--num-pages",
            "64",
            "--embedding-rows",
            "256",
        ],  # the default (Mooncake) transfer backend
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = await asyncio.to_thread(_read_ready_line, process)
        match = re.fullmatch(r"READY prefill port=(\d+) metrics_port=(\d+)", line)
        assert match, line
        channel = create_channel(f"127.0.0.1:{match.group(1)}")
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "stageserve.v1.Prefill"):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for auth in (
                None,
                Credentials("not-the-token"),
            ):  # the process requires the session's token
                await _check_unauthenticated(f"127.0.0.1:{match.group(1)}", auth)
        finally:
            await channel.close()
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _check_unauthenticated(address: str, auth: Credentials | None) -> None:
    channel = create_channel(address, auth=auth)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                prefill_pb2.PrefillRequest(), timeout=10
            )
    finally:
        await channel.close()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == "missing or invalid internal credentials"
