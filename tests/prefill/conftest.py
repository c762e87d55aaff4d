"""An in-process prefill service wired to a fake vision encoder and a fake decode pool.

The fake encoder is a real gRPC ``VisionEncoder`` server that runs the real vision tower
(the offline pipeline's) and writes rows through the in-process embedding sender. The
"decode" side is a KV pool registered with an in-process KV receiver. References come
from the offline engine on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
import pytest
import torch

from services.common import signing
from services.common.clients.decode import KvRefInfo, issue_kv_ref
from services.common.clients.prefill import PrefillClient
from services.common.clients.vision_encoder import (
    SpanResult,
    SpanStatus,
    VisionEncoderClient,
    embedding_destination_from_proto,
    encode_span_from_proto,
    span_result_to_proto,
)
from services.common.errors import DeadlineExceededError, UnavailableError
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import prefill_pb2_grpc, vision_encoder_pb2, vision_encoder_pb2_grpc
from services.common.server import HealthState, create_server
from services.common.types import ImageSpanRef, TokenizedPrompt
from services.engine.attention import ForwardMode
from services.engine.kv_cache import KVPageManager, KVPool
from services.engine.llm import EngineRequest
from services.engine.loader import load_model
from services.engine.processing import decode_image
from services.engine.processing.image import content_hash
from services.engine.sampler import SamplingParams
from services.prefill.app import PrefillApp
from services.prefill.config import PrefillConfig
from services.prefill.kv_refs import KvRefVerifier
from services.prefill.servicer import SERVICE_NAME, PrefillServicer
from services.transfer.embeddings_inprocess import (
    EmbeddingFabric,
    InProcessEmbeddingReceiver,
    InProcessEmbeddingSender,
)
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVReceiver, InProcessKVSender
from tests.conftest import TINY_MODEL_DIR, image_bytes

PAGE_SIZE = 4  # the session pipeline's page size: prompts span many pages
KEY = signing.key_of("prefill-test-token")  # the internal secret the fake decode signs with
KV_ATOL = 1e-5
WATCHDOG_POLL_S = 0.01


@pytest.fixture(scope="session")
def language_model():
    return load_model(TINY_MODEL_DIR, components=("language",))


# --- prompts and references ---------------------------------------------------------

@dataclass
class Case:
    request: EngineRequest  # the offline engine's view
    prompt: TokenizedPrompt  # what the router sends


def make_case(pipeline, request_id: str, text: str, images: list[bytes], params: SamplingParams) -> Case:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    request = pipeline.build_request([{"role": "user", "content": content}], images, params, request_id)
    hashes = [content_hash(data) for data in images]
    spans = tuple(
        ImageSpanRef(s.offset, s.length, h, s.grid_thw) for s, h in zip(request.spans, hashes, strict=True)
    )
    prompt = TokenizedPrompt(tuple(request.prompt_ids), spans, dict(zip(hashes, images, strict=True)))
    return Case(request, prompt)


def standard_cases(pipeline, params: SamplingParams | None = None) -> list[Case]:
    params = params or SamplingParams(temperature=0.0)
    return [
        make_case(pipeline, "text", "Write a line about the sea.", [], params),
        make_case(pipeline, "one-image", "What is in this picture?", [image_bytes(120, 80, seed=1)], params),
        make_case(
            pipeline, "two-images", "Compare the two.",
            [image_bytes(64, 200, seed=2), image_bytes(150, 90, seed=3)], params,
        ),
    ]


@dataclass
class Reference:
    first_token_id: int
    k: torch.Tensor  # [L, prompt_len, Hkv, D]
    v: torch.Tensor


def reference(pipeline, case: Case) -> Reference:
    """First token from ``LLMEngine.generate``; KV from an offline ModelRunner prefill of the prompt."""
    engine, runner = pipeline.engine, pipeline.engine.runner
    request = case.request
    one = dataclasses.replace(
        request, request_id=f"{request.request_id}-ref",
        params=msgspec.structs.replace(request.params, max_new_tokens=1),
    )
    first_token_id = engine.generate([one])[0].token_ids[0]
    n = len(request.prompt_ids)
    runner.page_table.reserve(one.request_id, n)
    try:
        step, _ = engine.prefill_input(one, engine.image_embeddings([one])[0])
        runner.forward(ForwardMode.EXTEND, [step])
        slots = runner.page_table.slots(one.request_id, 0, n)
        pool = runner.kv_pool
        k = torch.stack([pool.k_slots(layer)[slots] for layer in range(pool.num_layers)])
        v = torch.stack([pool.v_slots(layer)[slots] for layer in range(pool.num_layers)])
    finally:
        runner.page_table.release(one.request_id)
    return Reference(first_token_id, k.clone(), v.clone())


# --- the fake decode pool -------------------------------------------------------------

class DecodePool:
    """Decode's registered KV pool: pages handed out shuffled, so position order matters."""

    def __init__(self, model_config, fabric: InProcessFabric, num_pages: int = 512) -> None:
        text = model_config.text
        self.pool = KVPool(text.num_hidden_layers, num_pages, PAGE_SIZE, text.num_key_value_heads,
                           text.head_dim, torch.float32, "cpu")
        self.pages = KVPageManager(num_pages, PAGE_SIZE)
        self.receiver = InProcessKVReceiver(fabric)
        self.receiver.register(self.pool)
        self._rng = random.Random(0)

    def reserve(self, request_id: str, num_tokens: int, extra_pages: int = 2):
        pages = self.pages.allocate(-(-num_tokens // PAGE_SIZE) + extra_pages)
        self._rng.shuffle(pages)
        return self.receiver.destination(request_id, pages)

    @staticmethod
    def kv_ref(dst, expires_in_s: float = 60.0, key: bytes = KEY) -> KvRefInfo:
        """The KvRef decode issues for ``dst``: signed, with a fresh nonce."""
        expires_unix_ms = int((time.time() + expires_in_s) * 1000)
        return issue_kv_ref(dst, key, signing.new_nonce(), expires_unix_ms)

    def kv(self, dst, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(num_tokens)
        slots = torch.tensor(dst.page_ids)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        k = torch.stack([self.pool.k_slots(layer)[slots] for layer in range(self.pool.num_layers)])
        v = torch.stack([self.pool.v_slots(layer)[slots] for layer in range(self.pool.num_layers)])
        return k, v


# --- the fake vision encoder ------------------------------------------------------------

class FakeVisionEncoder(vision_encoder_pb2_grpc.VisionEncoderServicer):
    """Encodes every span with the real ViT (no cache) and writes rows in process; ``mode`` injects faults."""

    def __init__(self, pipeline, fabric: EmbeddingFabric) -> None:
        self.pipeline = pipeline
        self.sender = InProcessEmbeddingSender(fabric)
        self.mode = "ok"  # ok | unavailable | invalid | slow
        self.delay_s = 0.0
        self.num_calls = 0

    @handle_errors
    async def Encode(self, request: Any, context: Any) -> vision_encoder_pb2.EncodeResponse:
        self.num_calls += 1
        if self.mode == "unavailable":
            raise UnavailableError("fake encoder: ViT rank is down")
        if self.mode == "slow":
            await asyncio.sleep(self.delay_s)
        spans = [encode_span_from_proto(s) for s in request.spans]
        [dst] = [embedding_destination_from_proto(ref) for ref in request.embedding_refs]
        results = []
        for span in spans:
            if self.mode == "invalid":
                results.append(SpanResult(span.span.content_hash, SpanStatus.INVALID_IMAGE, False, 0, "not an image"))
                continue
            rows = self._encode(span.image_data)
            self.sender.send_rows(request.request_id, rows, dst, span.dest_row, time.monotonic() + 10)
            results.append(SpanResult(span.span.content_hash, SpanStatus.WRITTEN, is_cache_hit=False))
        return vision_encoder_pb2.EncodeResponse(results=[span_result_to_proto(r) for r in results])

    def _encode(self, data: bytes) -> torch.Tensor:
        processed = self.pipeline.images.preprocess(decode_image(data, 20 * 1024 * 1024))
        rows = self.pipeline.engine.runner.encode_images(processed.pixel_values, [processed.grid_thw])
        return rows.contiguous()  # [n, hidden] fp32


# --- the whole harness ------------------------------------------------------------------

@dataclass
class Harness:
    app: PrefillApp
    client: PrefillClient
    encoder: FakeVisionEncoder
    decode: DecodePool
    health: HealthState
    servers: list[grpc.aio.Server] = field(default_factory=list)

    @property
    def runner(self):
        return self.app.leader.worker.runner

    @property
    def scheduler(self):
        return self.app.leader.scheduler

    def assert_all_free(self) -> None:
        assert self.runner.page_manager.num_free_pages == self.runner.page_manager.num_pages
        assert len(self.runner.page_table) == 0
        rows = self.scheduler.rows
        assert rows.num_free_rows == rows.num_rows and rows.num_allocations == 0
        assert self.scheduler.num_live == 0

    async def prefill(self, case: Case, deadline_in_s: float = 30.0, extra_pages: int = 2):
        dst = self.decode.reserve(case.request.request_id, len(case.prompt.token_ids), extra_pages)
        kv_ref = self.decode.kv_ref(dst)  # what the router holds: DecodeClient.reserve's answer
        result = await self.client.prefill(
            case.request.request_id, case.prompt, case.request.params, kv_ref, time.time() + deadline_in_s
        )
        return result, dst


def prefill_config(**overrides: Any) -> PrefillConfig:
    values: dict[str, Any] = dict(
        model=TINY_MODEL_DIR, transfer_backend="inprocess", num_pages=256, page_size=PAGE_SIZE,
        embedding_rows=512, max_batch_tokens=2048, embedding_quarantine_s=0.0,
    )
    values.update(overrides)
    return PrefillConfig(**values)


async def start_harness(
    pipeline, language_model, config: PrefillConfig, *, embedding_fabric: EmbeddingFabric | None = None,
    encoder_address: str | None = None,
) -> Harness:
    """Prefill over gRPC; the fake encoder unless ``encoder_address`` names a real one on ``embedding_fabric``."""
    kv_fabric, embedding_fabric = InProcessFabric(), embedding_fabric or EmbeddingFabric()
    encoder = FakeVisionEncoder(pipeline, embedding_fabric)
    servers = []
    if encoder_address is None:
        encoder_server, encoder_port = create_server(
            [(vision_encoder_pb2_grpc.add_VisionEncoderServicer_to_server, encoder)], health=HealthState()
        )
        await encoder_server.start()
        servers.append(encoder_server)
        encoder_address = f"127.0.0.1:{encoder_port}"
    app = PrefillApp.build(
        config, encoder=VisionEncoderClient(encoder_address), model=language_model,
        kv_sender=InProcessKVSender(kv_fabric), embedding_receiver=InProcessEmbeddingReceiver(embedding_fabric),
    )
    await app.start()
    servicer = PrefillServicer(config.default_timeout_s, KvRefVerifier(KEY, config.max_kv_ref_nonces))
    servicer.attach(app.leader)
    health = HealthState()
    server, port = create_server(
        [(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)], service_names=[SERVICE_NAME], health=health,
    )
    await server.start()
    health.set_serving(True)
    app.leader.progress.start(health, interval_s=WATCHDOG_POLL_S)  # as services.prefill.__main__ does
    decode = DecodePool(language_model.config, kv_fabric)
    return Harness(app, PrefillClient(f"127.0.0.1:{port}"), encoder, decode, health, [server, *servers])


async def stop_harness(harness: Harness) -> None:
    await harness.client.close()
    for server in harness.servers:
        await server.stop(None)
    await harness.app.close()
    assert isinstance(harness.app.leader.encoder, VisionEncoderClient)
    await harness.app.leader.encoder.close()


@pytest.fixture
async def harness(pipeline, language_model) -> AsyncIterator[Harness]:
    h = await start_harness(pipeline, language_model, prefill_config())
    try:
        yield h
    finally:
        await stop_harness(h)


def record_sends(harness: Harness) -> list[str]:
    """Request ids of every KV write the worker begins (the only way it reaches a transfer engine)."""
    sender = harness.app.leader.worker.kv_sender
    calls: list[str] = []
    for name in ("start", "start_layerwise"):  # the worker begins every write with one of them
        method = getattr(sender, name)

        def recording(request_id, *args, _method=method):
            calls.append(request_id)
            return _method(request_id, *args)

        setattr(sender, name, recording)
    return calls


def gate_worker(harness: Harness) -> tuple[Callable[[], None], list[list[str]]]:
    """Hold the rank worker's first plan until ``release()``; records every plan's request ids."""
    import threading

    worker = harness.app.leader.worker
    execute, opened, plans = worker.execute, threading.Event(), []

    def gated(plan, *args):
        plans.append(plan.request_ids)
        opened.wait(30)
        return execute(plan, *args)

    worker.execute = gated
    return opened.set, plans


async def prefill_as_one_batch(harness: Harness, pipeline, cases: list[Case]) -> tuple[list, list[str]]:
    """Prefill ``cases`` in one plan: a first request holds the worker while they all queue.

    Returns each case's result (or exception) and the request ids of their plan.
    """
    release, plans = gate_worker(harness)
    blocker = asyncio.create_task(harness.prefill(make_case(pipeline, "first", "Hi.", [], SamplingParams())))
    while not plans:
        await asyncio.sleep(0.01)
    tasks = [asyncio.create_task(harness.prefill(case)) for case in cases]
    while harness.scheduler.num_live < len(cases) + 1 or harness.encoder.num_calls < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    release()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await blocker
    return results, plans[1]


async def prefill_abandoned_while_held(harness: Harness, case: Case) -> None:
    """Prefill ``case`` with a 1 s deadline while its plan is held in the worker: the caller gets
    DEADLINE_EXCEEDED first, then the plan runs and the service goes idle."""
    release, plans = gate_worker(harness)
    task = asyncio.create_task(harness.prefill(case, deadline_in_s=1.0))
    while not plans:  # the plan is held in the worker until the caller has given up
        await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceededError):
        await task
    release()
    while harness.scheduler.num_live:
        await asyncio.sleep(0.01)
