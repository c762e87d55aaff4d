"""In-process tokenizer servers (real gRPC on port 0) and helpers for the tokenizer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from services.common.client import create_channel, wait_ready
from services.common.clients.tokenizer import TokenizerClient
from services.common.pb.stageserve.v1 import tokenizer_pb2_grpc
from services.common.server import HealthState, create_server
from services.common.types import ChatMessage, ImagePart, TextPart
from services.tokenizer.config import Limits
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.workers import WorkerPool
from tests.conftest import TINY_MODEL_DIR

# Small limits so the over-limit tests send small messages.
TEST_LIMITS = Limits(max_model_len=4096, max_image_bytes=300_000, max_image_pixels=1_000_000)
TIMEOUT_S = 30.0


@dataclass
class Served:
    client: TokenizerClient
    address: str
    pool: WorkerPool
    metrics: TokenizerMetrics
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"stageserve_{name}", labels) or 0.0


async def start_served(num_workers: int, limits: Limits = TEST_LIMITS) -> tuple[Served, object]:
    pool = WorkerPool(TINY_MODEL_DIR, limits, num_workers)
    registry = CollectorRegistry()
    metrics = TokenizerMetrics(registry)
    servicer = TokenizerServicer(pool, metrics)
    health = HealthState()
    server, port = create_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer)],
        0,
        "127.0.0.1",
        [SERVICE_NAME],
        health=health,
    )
    await server.start()
    await pool.start()
    health.set_serving(True)
    address = f"127.0.0.1:{port}"
    # Answering before the tests call: a call whose connection attempt fails is
    # UNAVAILABLE at once (no wait-for-ready), which a loaded CI machine hit once.
    channel = create_channel(address)
    try:
        await wait_ready(channel, TIMEOUT_S)
    finally:
        await channel.close()
    return Served(TokenizerClient(address), address, pool, metrics, registry), server


async def stop_served(served: Served, server) -> None:
    await served.client.close()
    await server.stop(None)
    served.pool.close()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """A server whose CPU work runs on one thread (fast to start)."""
    s, server = await start_served(num_workers=0)
    try:
        yield s
    finally:
        await stop_served(s, server)


def user(*parts: str | bytes) -> ChatMessage:
    """A user message; str parts are text, bytes parts are images."""
    return ChatMessage(
        role="user",
        content=tuple(TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts),
    )


def to_template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The same chat as template dicts (images as ``{"type": "image"}``), for the offline reference."""
    return [
        {
            "role": m.role,
            "content": [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in m.content
            ],
        }
        for m in messages
    ]
