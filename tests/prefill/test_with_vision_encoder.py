"""Prefill (two CP ranks) against the real vision encoder service (in process), rows over shm to both ranks."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.common.server import HealthState
from services.engine.loader import load_model
from services.engine.sampler import SamplingParams
from services.transfer.embeddings_shm import ShmEmbeddingSender
from services.vision_encoder.app import build_app, create_grpc_server
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.metrics import VisionEncoderMetrics
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.prefill.conftest import make_case, prefill_config, reference, start_harness, stop_harness
from tests.prefill.test_service import assert_matches

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)


async def test_real_encoder_rows_and_cache_hits(pipeline, language_model) -> None:
    config = VisionEncoderConfig(model=TINY_MODEL_DIR, transfer_backend="shm")
    vision_model = load_model(TINY_MODEL_DIR, components=("vision",))
    encoder = build_app(config, VisionEncoderMetrics(CollectorRegistry()), ShmEmbeddingSender(), vision_model)
    server, port = create_grpc_server(encoder, config, HealthState())
    await server.start()
    harness = await start_harness(
        pipeline, language_model, prefill_config(devices=("cpu", "cpu")), encoder_address=f"127.0.0.1:{port}"
    )
    try:
        first, second = image_bytes(120, 80, seed=1), image_bytes(64, 200, seed=2)
        cases = [
            make_case(pipeline, "a", "What is in this picture?", [first], GREEDY),
            make_case(pipeline, "b", "And now?", [second, first], GREEDY),  # `first` is cached
        ]
        for case, num_cached in zip(cases, (0, cases[0].prompt.spans[0].length), strict=True):
            ref = reference(pipeline, case)
            result, dst = await harness.prefill(case)
            assert_matches(harness, case, result, dst, ref)
            assert result.num_cached_image_tokens == num_cached
        harness.assert_all_free()
    finally:
        await stop_harness(harness)
        await server.stop(None)
        encoder.close()
