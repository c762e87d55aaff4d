"""A prefill service (leader in process, C rank processes) wired to a fake vision encoder and a
fake decode pool.

The fake encoder is a real gRPC ``VisionEncoder`` server that runs the real vision tower
(the offline pipeline's) and writes rows into every rank's buffer over shm. The "decode"
side is a KV pool registered with a shm KV receiver, in this process. References come
from the offline engine on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
import pytest
import torch

from services.common.clients.prefill import PrefillClient
from services.common.clients.vision_encoder import (
    VisionEncoderClient,
)
from services.common.errors import DeadlineExceededError
from services.common.pb.stageserve.v1 import (
    prefill_pb2_grpc,
    vision_encoder_pb2_grpc,
)
from services.common.server import HealthState, create_server
from services.common.types import ImageSpanRef, SamplingParams, TokenizedPrompt
from services.engine.attention import ForwardMode
from services.engine.llm import EngineRequest
from services.engine.loader import load_model
from services.engine.processing.image_file import content_hash
from services.prefill.app import PrefillApp
from services.prefill.config import PrefillConfig
from services.prefill.image_store import ImageStore
from services.prefill.kv_refs import KvRefVerifier
from services.prefill.request import PrefillStatus
from services.prefill.servicer import SERVICE_NAME, PrefillServicer
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.prefill.cp_ranks import PAGE_SIZE, TARGET, RecordingResult, group_config, rank_env
from tests.prefill.fakes import KEY, DecodePool, FakeVisionEncoder

KV_ATOL = 1e-5
WATCHDOG_POLL_S = 0.01
WAIT_S = 30.0  # bound on every wait for a state: a hang fails the test instead of stalling it


@pytest.fixture(scope="session")
def language_model():
    return load_model(TINY_MODEL_DIR, components=("language",))


@pytest.fixture(autouse=True)
def prefill_rank_env(monkeypatch):
    """What the spawned rank processes inherit: one thread each, and this repo importable."""
    for key, value in rank_env().items():
        monkeypatch.setenv(key, value)


# --- prompts and references ---------------------------------------------------------
@dataclass
class Case:
    request: EngineRequest  # the offline engine's view
    prompt: TokenizedPrompt  # what the router sends


def make_case(
    pipeline, request_id: str, text: str, images: list[bytes], params: SamplingParams
) -> Case:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in images] + [
        {"type": "text", "text": text}
    ]
    request = pipeline.build_request(
        [{"role": "user", "content": content}], images, params, request_id
    )
    hashes = [content_hash(data) for data in images]
    spans = tuple(
        ImageSpanRef(s.offset, s.length, h, s.grid_thw)
        for s, h in zip(request.spans, hashes, strict=True)
    )
    prompt = TokenizedPrompt(
        tuple(request.prompt_ids), spans, dict(zip(hashes, images, strict=True))
    )
    return Case(request, prompt)


def standard_cases(pipeline, params: SamplingParams | None = None) -> list[Case]:
    params = params or SamplingParams(temperature=0.0)
    return [
        make_case(pipeline, "text", "Write a line about the sea.", [], params),
        make_case(
            pipeline,
            "one-image",
            "What is in this picture?",
            [image_bytes(120, 80, seed=1)],
            params,
        ),
        make_case(
            pipeline,
            "two-images",
            "Compare the two.",
            [image_bytes(64, 200, seed=2), image_bytes(150, 90, seed=3)],
            params,
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
        request,
        request_id=f"{request.request_id}-ref",
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


# --- the whole harness ------------------------------------------------------------------


@dataclass
class Harness:
    app: PrefillApp
    client: PrefillClient
    encoder: FakeVisionEncoder
    decode: DecodePool
    health: HealthState
    images: ImageStore
    servers: list[grpc.aio.Server] = field(default_factory=list)

    @property
    def leader(self):
        return self.app.leader

    @property
    def scheduler(self):
        return self.app.leader.scheduler

    def assert_all_free(self) -> None:
        rows = self.scheduler.rows
        assert rows.num_free_rows == rows.num_rows and rows.num_allocations == 0
        assert self.scheduler.num_live == 0

    async def prefill(self, case: Case, deadline_in_s: float = 30.0, extra_pages: int = 2):
        dst = self.decode.reserve(case.request.request_id, len(case.prompt.token_ids), extra_pages)
        kv_ref = self.decode.kv_ref(dst)  # what the router holds: DecodeClient.reserve's answer
        result = await self.client.prefill(
            case.request.request_id,
            case.prompt,
            case.request.params,
            kv_ref,
            time.time() + deadline_in_s,
        )
        return result, dst


def prefill_config(**overrides: Any) -> PrefillConfig:
    values: dict[str, Any] = dict(
        model=TINY_MODEL_DIR,
        transfer_backend="shm",
        num_pages=256,
        page_size=PAGE_SIZE,
        embedding_rows=512,
        max_batch_tokens=2048,
        embedding_quarantine_s=0.0,
        cp_min_tokens=1,
        cp_block_tokens=PAGE_SIZE,
    )
    values.update(overrides)
    return PrefillConfig(**values)


async def start_harness(
    pipeline,
    language_model,
    config: PrefillConfig,
    *,
    encoder_address: str | None = None,
    step_target: str = TARGET,
    **group_overrides: Any,
) -> Harness:
    """Prefill over gRPC on ``config.devices``; the fake encoder unless ``encoder_address`` names a
    real one."""
    encoder = FakeVisionEncoder(pipeline)
    servers = []
    if encoder_address is None:
        encoder_server, encoder_port = create_server(
            [(vision_encoder_pb2_grpc.add_VisionEncoderServicer_to_server, encoder)],
            health=HealthState(),
        )
        await encoder_server.start()
        servers.append(encoder_server)
        encoder_address = f"127.0.0.1:{encoder_port}"
    devices = group_overrides.pop("devices", config.devices)  # a group's own: 'join' ranks
    group = group_config(config.num_ranks, **group_overrides, devices=devices, name="prefill")
    app = PrefillApp.build(
        config,
        internal_token=os.environ["STAGESERVE_INTERNAL_TOKEN"],
        encoder=VisionEncoderClient(encoder_address),
        group=group,
        step_target=step_target,
        result_type=RecordingResult,
    )
    health = HealthState()
    app.leader.on_serving = health.set_serving
    await app.start()
    images = ImageStore(config.image_store_mb * 1024 * 1024)
    servicer = PrefillServicer(
        config.default_timeout_s, KvRefVerifier(KEY, config.max_kv_ref_nonces), images
    )
    servicer.attach(app.leader)
    server, port = create_server(
        [(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        health=health,
    )
    await server.start()
    app.leader.progress.start(
        health, interval_s=WATCHDOG_POLL_S
    )  # as services.prefill.__main__ does
    decode = DecodePool(language_model.config)
    return Harness(
        app,
        PrefillClient(f"127.0.0.1:{port}"),
        encoder,
        decode,
        health,
        images,
        [server, *servers],
    )


async def stop_harness(harness: Harness) -> None:
    await harness.client.close()
    for server in harness.servers:
        await server.stop(None)
    await harness.app.close()
    assert isinstance(harness.app.leader.encoder, VisionEncoderClient)
    await harness.app.leader.encoder.close()
    harness.encoder.sender.close()
    harness.decode.close()


@pytest.fixture
async def harness(pipeline, language_model) -> AsyncIterator[Harness]:
    h = await start_harness(pipeline, language_model, prefill_config())
    try:
        yield h
    finally:
        await stop_harness(h)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def wait_until_ready(harness: Harness, num_requests: int) -> None:
    """Until ``num_requests`` requests are READY (text admitted, every image's Encode done)."""
    await wait_until(lambda: harness.scheduler.num_in(PrefillStatus.READY) == num_requests)


def record_sends(harness: Harness) -> list[str]:
    """Request ids of every plan the leader sends to the ranks (the only way a request reaches a
    rank, and so a transfer engine)."""
    ranks = harness.app.leader.ranks
    step, sent = ranks.step, []

    async def recording(payload, *args):
        sent.extend(r.request_id for r in getattr(payload, "requests", ()))
        return await step(payload, *args)

    ranks.step = recording
    return sent


def gate_worker(harness: Harness) -> tuple[Callable[[], None], list[list[str]]]:
    """Hold the leader's next plan before it reaches the ranks until ``release()``; records every
    plan's request ids (Describe steps pass)."""
    import threading

    ranks = harness.app.leader.ranks
    step, opened, plans = ranks.step, threading.Event(), []

    async def gated(payload, *args):
        if hasattr(payload, "requests"):
            plans.append([r.request_id for r in payload.requests])
            while not opened.is_set():
                await asyncio.sleep(0.01)
        return await step(payload, *args)

    ranks.step = gated
    return opened.set, plans


async def prefill_as_one_batch(
    harness: Harness, pipeline, cases: list[Case]
) -> tuple[list, list[str]]:
    """Prefill ``cases`` in one plan: a first request holds the ranks while they all queue.

    Returns each case's result (or exception) and the request ids of their plan.
    """
    release, plans = gate_worker(harness)
    blocker = asyncio.create_task(
        harness.prefill(make_case(pipeline, "first", "Hi.", [], SamplingParams()))
    )
    await wait_until(lambda: bool(plans))
    tasks = [asyncio.create_task(harness.prefill(case)) for case in cases]
    await wait_until_ready(harness, len(cases))
    release()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await blocker
    return results, plans[1]


async def prefill_abandoned_while_held(harness: Harness, case: Case):
    """Prefill ``case`` with a 1 s deadline while its plan is held before the ranks: the caller gets
    DEADLINE_EXCEEDED first, then the plan runs and the service goes idle. Returns its KV
    destination."""
    release, plans = gate_worker(harness)
    dst = harness.decode.reserve(case.request.request_id, len(case.prompt.token_ids))
    task = asyncio.create_task(
        harness.client.prefill(
            case.request.request_id,
            case.prompt,
            case.request.params,
            harness.decode.kv_ref(dst),
            time.time() + 1.0,
        )
    )
    while not plans:  # the plan is held until the caller has given up
        await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceededError):
        await task
    release()
    while harness.scheduler.num_live:
        await asyncio.sleep(0.01)
    return dst
