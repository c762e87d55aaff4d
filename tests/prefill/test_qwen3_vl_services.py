"""Qwen3-VL across the stage split: the real vision encoder (one rank process) writes each
image's merged and DeepStack rows over shm into both CP ranks' buffers of prefill (two rank
processes, every request sharded), and the first token and KV equal the offline engine's,
for an image that straddles the CP shard boundary, a cached image, and a text request in one
pass with an image request. The same KV is far from what the DeepStack rows give when they
are dropped, added after the wrong decoder layers, or shifted by one token, so a service
that did any of these would fail here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.common.types import SamplingParams
from services.engine.attention import ForwardMode
from services.engine.attention.context_parallel import CpShard
from services.engine.config import ModelConfig
from services.engine.loader import load_model
from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.prefill.conftest import (
    KV_ATOL,
    Case,
    make_case,
    prefill_as_one_batch,
    prefill_config,
    reference,
    start_harness,
    stop_harness,
)
from tests.prefill.cp_ranks import PAGE_SIZE
from tests.prefill.test_service import assert_matches
from tests.vision_encoder.conftest import serve_encoder

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ASSETS = TINY_MODEL_DIR.parent
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def model_dir(request) -> Path:
    return ASSETS / request.param


@pytest.fixture(scope="module")
def qwen3_pipeline(model_dir) -> OfflinePipeline:
    return OfflinePipeline.from_dir(model_dir, page_size=PAGE_SIZE, num_pages=2048)


@pytest.fixture(scope="module")
def qwen3_language(model_dir):
    return load_model(model_dir, components=("language",))


def keys_with(
    pipeline: OfflinePipeline, case: Case, rows: torch.Tensor, layers: tuple[int, ...]
) -> torch.Tensor:
    """K [L, prompt_len, Hkv, D] of the offline prefill of ``case`` with image rows ``rows``
    and the DeepStack sets added after decoder ``layers``."""
    engine, runner = pipeline.engine, pipeline.engine.runner
    request = dataclasses.replace(case.request, request_id=f"{case.request.request_id}-variant")
    language = runner.model.model
    saved, language.deepstack_layers = language.deepstack_layers, layers
    n = len(request.prompt_ids)
    runner.page_table.reserve(request.request_id, n)
    try:
        step, _ = engine.prefill_input(request, rows)
        runner.forward(ForwardMode.EXTEND, [step])
        slots = runner.page_table.slots(request.request_id, 0, n)
        pool = runner.kv_pool
        return torch.stack([pool.k_slots(layer)[slots] for layer in range(pool.num_layers)])
    finally:
        runner.page_table.release(request.request_id)
        language.deepstack_layers = saved


def assert_deepstack_matters(pipeline: OfflinePipeline, case: Case, served: torch.Tensor) -> None:
    """``served`` is far from the KV of each DeepStack mistake (dropped, wrong layers, one
    token off)."""
    (rows,) = pipeline.engine.image_embeddings([case.request])
    hidden = pipeline.engine.runner.model.config.text.hidden_size
    num_sets = rows.shape[1] // hidden - 1
    assert num_sets == 2 and rows[:, hidden:].abs().amax() > 0
    right = tuple(range(num_sets))
    dropped = torch.cat([rows[:, :hidden], torch.zeros_like(rows[:, hidden:])], dim=1)
    shifted = torch.cat([rows[:, :hidden], rows[:, hidden:].roll(1, dims=0)], dim=1)
    variants = {
        "dropped": keys_with(pipeline, case, dropped, right),
        "wrong layer": keys_with(pipeline, case, rows, tuple(i + 1 for i in right)),
        "one token off": keys_with(pipeline, case, shifted, right),
    }
    for name, k in variants.items():
        assert (served - k).abs().amax() > 100 * KV_ATOL, name


def straddling_case(pipeline: OfflinePipeline, world_size: int) -> Case:
    image = image_bytes(120, 80, seed=1)
    case = make_case(pipeline, "straddle", "What is in it?", [image], GREEDY)
    (span,) = case.prompt.spans
    shard = CpShard(0, world_size, PAGE_SIZE)
    owners = {shard.owner(i) for i in range(span.offset, span.offset + span.length)}
    assert owners == set(range(world_size)) and span.offset % PAGE_SIZE, "straddles mid-block"
    return case


async def test_deepstack_rows_cross_the_split_on_two_cp_ranks(
    model_dir, qwen3_pipeline, qwen3_language
):
    pipeline = qwen3_pipeline
    config = ModelConfig.from_dir(model_dir)
    with serve_encoder(1, model=model_dir) as encoder:
        assert encoder.app.limits.hidden_size == config.embedding_row_width == 3 * 64
        harness = await start_harness(
            pipeline,
            qwen3_language,
            prefill_config(model=model_dir, devices=("cpu", "cpu")),
            encoder_address=encoder.address,
        )
        try:
            first = straddling_case(pipeline, 2)
            result, dst = await harness.prefill(first)
            assert_matches(harness, first, result, dst, reference(pipeline, first))
            assert result.num_cached_image_tokens == 0
            assert_deepstack_matters(
                pipeline, first, harness.decode.kv(dst, len(first.prompt.token_ids))[0]
            )
            (span,) = first.prompt.spans
            row_bytes = config.embedding_row_width * 4  # fp32 rows
            assert encoder.value("cache_bytes") == span.length * row_bytes

            second = image_bytes(64, 200, seed=2)
            again = make_case(
                pipeline, "again", "And this?", [second, image_bytes(120, 80, seed=1)], GREEDY
            )
            result, dst = await harness.prefill(again)
            assert_matches(harness, again, result, dst, reference(pipeline, again))
            assert result.num_cached_image_tokens == span.length  # the first image, from cache
            num_rows = sum(s.length for s in again.prompt.spans)
            assert encoder.value("cache_bytes") == num_rows * row_bytes
            harness.assert_all_free()

            cases = [
                make_case(pipeline, "text", "Say something.", [], GREEDY),
                make_case(pipeline, "image", "Describe.", [image_bytes(90, 90, seed=3)], GREEDY),
            ]
            results, plan = await prefill_as_one_batch(harness, pipeline, cases)
            assert sorted(plan) == ["image", "text"]
            for case, (result, dst) in zip(cases, results, strict=True):
                assert_matches(harness, case, result, dst, reference(pipeline, case))
            harness.assert_all_free()
        finally:
            await stop_harness(harness)
