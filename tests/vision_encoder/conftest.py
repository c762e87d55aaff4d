"""Fixtures: the tiny vision tower (loaded once), and an in-process encoder behind a real gRPC server."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.clients.vision_encoder import EncodeSpanInput, VisionEncoderClient
from services.common.server import HealthState
from services.common.types import ImageSpanRef
from services.engine.processing.image import ImageProcessor, decode_image
from services.transfer.embeddings import EmbeddingBuffer, EmbeddingRowManager
from services.transfer.embeddings_inprocess import (
    EmbeddingFabric,
    InProcessEmbeddingReceiver,
    InProcessEmbeddingSender,
)
from services.vision_encoder.app import VisionEncoderApp, build_app, create_grpc_server
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.metrics import VisionEncoderMetrics
from tests.conftest import TINY_MODEL_DIR

WATCHDOG_POLL_S = 0.01


@pytest.fixture(scope="session")
def vision_model():
    from services.engine.loader import load_model

    return load_model(TINY_MODEL_DIR, "cpu", None, components=("vision",))


@pytest.fixture(scope="session")
def image_processor() -> ImageProcessor:
    return ImageProcessor.from_dir(TINY_MODEL_DIR)


def span_input(processor: ImageProcessor, data: bytes, dest_row: int, offset: int = 0) -> EncodeSpanInput:
    grid = processor.grid_for(decode_image(data, 1 << 30))
    span = ImageSpanRef(offset, processor.num_image_tokens(grid), hashlib.sha256(data).hexdigest(), grid)
    return EncodeSpanInput(span, data, dest_row)


def spans_for(processor: ImageProcessor, images: list[bytes]) -> list[EncodeSpanInput]:
    """One span per image, rows packed one after another from row 0."""
    spans, row = [], 0
    for data in images:
        spans.append(span_input(processor, data, row))
        row += spans[-1].span.length
    return spans


@dataclass
class Encoder:
    """A running encoder (real gRPC, in-process transfer) and a prefill-like receiver."""

    app: VisionEncoderApp
    client: VisionEncoderClient
    metrics: VisionEncoderMetrics
    registry: CollectorRegistry
    receiver: InProcessEmbeddingReceiver
    buffer: EmbeddingBuffer
    rows: EmbeddingRowManager
    address: str
    fabric: EmbeddingFabric
    health: HealthState

    def counter(self, name: str) -> float:
        return self.registry.get_sample_value(f"stageserve_vision_encoder_{name}_total") or 0.0


@contextlib.asynccontextmanager
async def running_encoder(model, **overrides) -> AsyncIterator[Encoder]:
    fabric = EmbeddingFabric()
    config = replace(VisionEncoderConfig(model=TINY_MODEL_DIR, transfer_backend="inprocess"), **overrides)
    registry = CollectorRegistry()
    metrics = VisionEncoderMetrics(registry)
    app = build_app(config, metrics, sender=InProcessEmbeddingSender(fabric), model=model)
    receiver = InProcessEmbeddingReceiver(fabric)
    buffer = EmbeddingBuffer(4096, app.worker.hidden_size, torch.float32)
    buffer.tensor.fill_(float("nan"))
    receiver.register(buffer)
    health = HealthState()
    server, port = create_grpc_server(app, config, health)
    await server.start()
    health.set_serving(True)
    app.leader.progress.start(health, interval_s=WATCHDOG_POLL_S)  # as services.vision_encoder.__main__ does
    client = VisionEncoderClient(f"127.0.0.1:{port}")
    try:
        yield Encoder(
            app, client, metrics, registry, receiver, buffer, EmbeddingRowManager(4096), f"127.0.0.1:{port}", fabric,
            health,
        )
    finally:
        await client.close()
        await server.stop(1.0)
        app.close()
        receiver.close()


def gate_worker(encoder: Encoder) -> tuple[Callable[[], None], list[list[str]]]:
    """Hold the rank worker's first batch until ``release()``; records every batch's request ids."""
    worker = encoder.app.worker
    execute, opened, batches = worker.execute, threading.Event(), []

    def gated(batch, plan):
        batches.append([job.request_id for job in batch.jobs])
        opened.wait(30)
        return execute(batch, plan)

    worker.execute = gated
    return opened.set, batches
