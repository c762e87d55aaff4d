"""Fixtures shared by the tests of services.common."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from services.common.client import create_channel
from services.common.pb.stageserve.v1 import decode_pb2_grpc
from services.common.server import HealthState, RpcMetrics, create_server
from tests.common.ranks_group_helpers import REPO
from tests.common.server_helpers import DECODE, FakeDecode, Served


@pytest.fixture
def rank_env(monkeypatch):
    """What the spawned ranks inherit: one thread each, and this repo importable."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    )


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
