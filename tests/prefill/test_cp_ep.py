"""Context-parallel prefill with an MoE model's experts split over the same ranks (``--tp 1
--ep 2``: CP = 2 x EP = 2, real processes, gloo): each rank holds attention whole and half of
every MoE layer's experts, and each layer's MLP runs on both ranks' tokens. On the tiny
Qwen3-VL-MoE it equals one rank: the first token, its logits within 1e-4 (fp32) and decode's
KV pages, for text, one and two images and a long prompt, blocks of 1 and 16 tokens, chunked
passes (a chunk with no tokens on a rank), a plan one rank runs alone (the other joins every
layer's gather with none) and every case in one plan. Behind the service (leader, scheduler,
prefix cache) a batch of prompts and prompts whose prefix is cached equal the offline engine,
and a rank that raises mid-pass fails its request and the group re-forms (as under TP: its
peer waits in the layer's MoE collective, which no poisoned K/V all-gather covers).
"""

from __future__ import annotations

import asyncio

import pytest

from services.common.types import SamplingParams
from services.engine.loader import load_model
from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.prefill.conftest import (
    KV_ATOL,
    make_case,
    prefill_as_one_batch,
    prefill_config,
    reference,
    standard_cases,
    start_harness,
    stop_harness,
)
from tests.prefill.cp_ranks import PAGE_SIZE, DecodePool, rank_init, started_ranks
from tests.prefill.group_faults import failed_prefill, text_case
from tests.prefill.test_cp_exactness import Runner, assert_equal_runs, cases, references
from tests.prefill.test_service import assert_matches
from tests.prefill.test_tp_faults import serves_again

pytestmark = pytest.mark.slow
MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
NUM_EXPERTS = 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def moe_pipeline() -> OfflinePipeline:
    return OfflinePipeline.from_dir(MOE_DIR, page_size=PAGE_SIZE, num_pages=2048)


@pytest.fixture(scope="module")
def moe_language():
    return load_model(MOE_DIR, components=("language",))


@pytest.fixture(scope="module")
def moe_references(moe_pipeline, moe_language) -> dict:
    init = rank_init(model=str(MOE_DIR))
    return asyncio.run(references(moe_pipeline, moe_language, init))


def test_one_rank_equals_the_offline_engine(moe_pipeline, moe_references) -> None:
    for case in cases(moe_pipeline):
        ref = reference(moe_pipeline, case)
        _, k, v, token, results = moe_references[case.request.request_id]
        assert token == ref.first_token_id, case.request.request_id
        assert (k - ref.k).abs().max() <= KV_ATOL and (v - ref.v).abs().max() <= KV_ATOL
        assert results[0].num_experts_held == NUM_EXPERTS


async def test_cp_ep_ranks_equal_one_rank(moe_pipeline, moe_language, moe_references) -> None:
    decode = DecodePool(moe_language.config)
    every = cases(moe_pipeline)
    try:
        async with started_ranks(2, rank_init(model=str(MOE_DIR), ep_size=2)) as ranks:
            runner = Runner(moe_pipeline, ranks, decode)
            for case in every:
                name = case.request.request_id
                want = moe_references[name]
                for block_tokens in (1, 16):
                    got = await runner.run(case, block_tokens=block_tokens)
                    assert_equal_runs(got, want, f"{name} B={block_tokens}")
                    assert [r.num_experts_held for r in got[4]] == [NUM_EXPERTS // 2] * 2
                    assert all(r.outcomes for r in got[4])  # every rank ran it
                got = await runner.run(case, block_tokens=16, chunk_tokens=13)
                assert_equal_runs(got, want, f"{name} chunked")
                for solo in (0, 1):
                    got = await runner.run(case, solo_rank=solo)
                    assert_equal_runs(got, want, f"{name} solo on rank {solo}")
                    assert [bool(r.outcomes) for r in got[4]] == [r == solo for r in range(2)]
            long_text = every[-1]
            got = await runner.run(long_text, chunk_tokens=13, solo_rank=1)  # idle passes
            assert_equal_runs(got, moe_references[long_text.request.request_id], "solo chunks")
            for block_tokens in (1, 16):
                runs = await runner.run_batch(every, block_tokens=block_tokens)
                for case, got in zip(every, runs, strict=True):
                    name = case.request.request_id
                    assert_equal_runs(got, moe_references[name], f"{name} in a batch")
    finally:
        decode.close()


async def test_the_service_batches_and_reads_cached_prefixes(moe_pipeline, moe_language) -> None:
    config = prefill_config(model=MOE_DIR, devices=("cpu", "cpu"), ep=2)
    h = await start_harness(moe_pipeline, moe_language, config)
    try:
        batch = standard_cases(moe_pipeline)
        results, plan = await prefill_as_one_batch(h, moe_pipeline, batch)
        assert sorted(plan) == sorted(c.request.request_id for c in batch)
        for case, result in zip(batch, results, strict=True):
            assert_matches(h, case, *result, reference(moe_pipeline, case))
        stem = "Describe the picture in the style of a ship's log. " * 2
        image = image_bytes(96, 64, seed=7)
        turns = [
            make_case(moe_pipeline, "log", stem + "Be brief.", [image], GREEDY),
            make_case(
                moe_pipeline, "log-long", stem + "Take your time, tell it all.", [image], GREEDY
            ),
            make_case(moe_pipeline, "log-again", stem + "Be brief.", [image], GREEDY),
        ]
        cached = []
        for case in turns:
            result, dst = await h.prefill(case)
            assert_matches(h, case, result, dst, reference(moe_pipeline, case))
            (span,) = case.request.spans
            assert result.num_prefix_cached_image_tokens == span.length * bool(cached)
            cached.append(result.num_prefix_cached_tokens)
        n_long, n_again = (len(c.prompt.token_ids) for c in turns[1:])
        assert 0 < cached[1] < n_long - PAGE_SIZE  # a partial hit: both ranks compute
        assert cached[2] == (n_again - 1) // PAGE_SIZE * PAGE_SIZE  # one rank computes
        h.assert_all_free()
    finally:
        await stop_harness(h)


async def test_a_rank_raising_mid_pass_fails_the_step_and_the_group_re_forms(
    moe_pipeline, moe_language
) -> None:
    config = prefill_config(model=MOE_DIR, devices=("cpu", "cpu"), ep=2, step_timeout_s=30.0)
    h = await start_harness(
        moe_pipeline, moe_language, config, step_timeout_s=30.0, collective_timeout_s=5.0
    )
    try:
        pids = h.app.ranks.rank_pids
        _, dst = await failed_prefill(h, text_case(moe_pipeline, "raise-r1-l1", "Hi there!"))
        assert not h.decode.is_written(dst)
        await serves_again(h, moe_pipeline, pids)
    finally:
        await stop_harness(h)
