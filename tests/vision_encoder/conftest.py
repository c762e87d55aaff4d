"""Fixtures: the tiny vision tower (in this process, for references) and real encoders.

``serve_encoder(num_ranks)`` runs the encoder's leader and gRPC server on an event loop of
their own thread, with W real rank processes (gloo on CPU, each loading the tiny tower),
and rows over shared memory into a prefill-like receiver of this process. Rank processes
take a few seconds each to start on a loaded machine, so test modules share one encoder
(module-scoped fixtures) and count metrics as deltas. The ranks run the hooked step of
``rank_hooks.py`` (the real step plus test hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.clients.vision_encoder import EncodeSpanInput, SpanResult, VisionEncoderClient
from services.common.destinations import EmbeddingDestination
from services.common.envs import Envs
from services.common.server import HealthState
from services.common.types import ImageSpanRef
from services.engine.processing.image import ImageProcessor
from services.engine.processing.image_file import decode_image
from services.transfer import create_embedding_receiver
from services.transfer.embeddings import EmbeddingBuffer, EmbeddingRowManager
from services.vision_encoder.app import VisionEncoderApp, build_app, create_grpc_server
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.metrics import VisionEncoderMetrics
from tests.conftest import REPO, TINY_MODEL_DIR, environ, rank_children

HOOKED_STEP = "tests.vision_encoder.rank_hooks:HookedEncoderStep"
START_TIMEOUT_S = 300.0  # W torch imports at once on a loaded 2-core machine
CALL_TIMEOUT_S = 60.0
WATCHDOG_POLL_S = 0.01


@pytest.fixture(scope="session")
def vision_model():
    from services.engine.loader import load_model

    return load_model(TINY_MODEL_DIR, "cpu", None, components=("vision",))


@pytest.fixture(scope="session")
def image_processor() -> ImageProcessor:
    return ImageProcessor.from_dir(TINY_MODEL_DIR)


def span_input(
    processor: ImageProcessor, data: bytes, dest_row: int, offset: int = 0
) -> EncodeSpanInput:
    grid = processor.grid_for(decode_image(data, 1 << 30))
    span = ImageSpanRef(
        offset, processor.num_image_tokens(grid), hashlib.sha256(data).hexdigest(), grid
    )
    return EncodeSpanInput(span, data, dest_row)


def spans_for(processor: ImageProcessor, images: list[bytes]) -> list[EncodeSpanInput]:
    """One span per image, rows packed one after another from row 0."""
    spans, row = [], 0
    for data in images:
        spans.append(span_input(processor, data, row))
        row += spans[-1].span.length
    return spans


@contextlib.contextmanager
def rank_threads() -> Iterator[None]:
    """Compute as the test ranks do, on one thread: fp32 GEMMs round differently on two."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def reference_rows(model, processor: ImageProcessor, images: list[bytes]) -> list[torch.Tensor]:
    """Each image's rows from the tiny tower in this process (one ViT call per image)."""
    rows = []
    for data in images:
        processed = processor.preprocess(decode_image(data, 1 << 30))
        with torch.inference_mode(), rank_threads():
            rows.append(model.encode_images(processed.pixel_values, [processed.grid_thw]))
    return rows


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Rows of the same images from ViT calls that batched them differently (one call per image,
    or a rank's images together): equal up to the CPU BLAS's batch variance. MKL / oneDNN pick a
    matmul kernel by the row count, so on an AVX512 Xeon the patch merger's 4-row linear of a
    4x4-patch image differs from the same rows inside a longer batch by ~1e-6 (other CPUs give
    equal bits). A wrong, missing or misplaced row is off by far more."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def rank_environment() -> Iterator[None]:
    """What spawned ranks inherit: one thread each, and this repo importable (the hooked step)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    with environ({"OMP_NUM_THREADS": "1", "PYTHONPATH": path}):
        yield


class Prefill:
    """A prefill-like receiver: one registered buffer (NaN until written), over shared memory
    unless ``backend`` names another (cuda_ipc: on ``device``)."""

    def __init__(
        self,
        hidden_size: int,
        num_rows: int = 4096,
        dtype=torch.float32,
        backend: str = "shm",
        device: str = "cpu",
    ) -> None:
        self.receiver = create_embedding_receiver(backend)
        self.buffer = EmbeddingBuffer(num_rows, hidden_size, dtype, device)
        self.buffer.tensor.fill_(float("nan"))
        self.receiver.register(self.buffer)
        self.rows = EmbeddingRowManager(num_rows)

    def destination(self, request_id: str, start: int, num_rows: int) -> EmbeddingDestination:
        return self.receiver.destination(request_id, start, num_rows)

    def close(self) -> None:
        self.receiver.close()


@dataclass
class ServedEncoder:
    """A running encoder: its app and gRPC server on ``loop`` (a thread of its own)."""

    app: VisionEncoderApp
    config: VisionEncoderConfig
    registry: CollectorRegistry
    health: HealthState
    address: str
    loop: asyncio.AbstractEventLoop
    prefills: list[Prefill] = field(default_factory=list)

    @property
    def num_ranks(self) -> int:
        return self.config.num_ranks

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """Run ``coro`` on the encoder's loop and wait for it (blocking)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` run on the encoder's loop, from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def prefill(self, **kwargs: Any) -> Prefill:
        """A new receiver, closed with the encoder."""
        prefill = Prefill(self.app.limits.hidden_size, **kwargs)
        self.prefills.append(prefill)
        return prefill

    async def encode(
        self, request_id: str, spans, destination, timeout_s: float = CALL_TIMEOUT_S
    ) -> list[SpanResult]:
        client = VisionEncoderClient(self.address)
        try:
            return await client.encode(request_id, spans, destination, timeout_s)
        finally:
            await client.close()

    def value(self, name: str, **labels: str) -> float:
        """A metric's value summed over every sample matching ``labels`` (0 when none)."""
        total = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == f"stageserve_vision_encoder_{name}" and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total

    def counter(self, name: str, **labels: str) -> float:
        return self.value(f"{name}_total", **labels)

    def per_rank(self, name: str) -> list[float]:
        return [self.counter(name, rank=str(r)) for r in range(self.num_ranks)]

    async def hook(self, payload: Any) -> None:
        """Step a test hook (``rank_hooks``) past the leader: on its ``rank``'s group, else on
        every rank's."""
        rank = getattr(payload, "rank", None)
        groups = self.app.groups if rank is None else (self.app.groups[rank],)

        async def step_all() -> None:
            await asyncio.gather(*(group.step(payload) for group in groups))

        await self.on_loop(step_all())


async def _start(config: VisionEncoderConfig, registry: CollectorRegistry, step_target: str):
    app = build_app(
        config, VisionEncoderMetrics(registry), Envs.from_environ(), step_target=step_target
    )
    health = HealthState()
    server, port = create_grpc_server(app, config, health)
    await server.start()
    try:
        await app.start(health, watchdog_poll_s=WATCHDOG_POLL_S)
    except BaseException:
        await server.stop(None)
        raise
    return app, health, server, port


@contextlib.contextmanager
def serve_encoder(
    num_ranks: int = 1, *, step_target: str = HOOKED_STEP, **overrides
) -> Iterator[ServedEncoder]:
    """An encoder with ``num_ranks`` CPU rank processes; every rank is gone after it."""
    config = replace(
        VisionEncoderConfig(
            model=TINY_MODEL_DIR, transfer_backend="shm", devices=("cpu",) * num_ranks
        ),
        **overrides,
    )
    registry = CollectorRegistry()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="encoder-loop", daemon=True)
    thread.start()
    served: ServedEncoder | None = None
    try:
        with rank_environment():
            started = asyncio.run_coroutine_threadsafe(_start(config, registry, step_target), loop)
            app, health, server, port = started.result(START_TIMEOUT_S)
        served = ServedEncoder(app, config, registry, health, f"127.0.0.1:{port}", loop)
        pids = set(app.leader.rank_pids)
        try:
            yield served
        finally:
            pids.update(app.leader.rank_pids)  # a re-formed group's too
            served.run(server.stop(None))
            served.run(app.close())
        assert [pid for pid in pids if pid in rank_children()] == []
    finally:
        if served is not None:
            for prefill in served.prefills:
                prefill.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def wait_until(predicate, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)
