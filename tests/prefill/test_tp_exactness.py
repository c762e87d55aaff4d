"""Tensor-parallel prefill rank groups (real processes, gloo) equal one rank: the first token,
its logits within 1e-4 (fp32) and every KV head written into decode's pages (a pool that holds
all of them, as a decode rank does), for text, images and chunked passes.

TP = 2 gives each rank one of the tiny model's two KV heads; TP = 4 gives each one, held by two
ranks, and only the first of them writes it; CP = 2 x TP = 2 shards each pass over two TP
groups. The group's first TP rank samples; the others report no token.
"""

from __future__ import annotations

import pytest

from tests.prefill.cp_ranks import DecodePool, rank_init, started_ranks
from tests.prefill.test_cp_exactness import Runner, assert_equal_runs, cases, reference_runs

pytestmark = pytest.mark.slow
__all__ = ["reference_runs"]  # the module fixture: one TP = 1 run of every case


def sampled_by(results) -> list[int]:
    """The ranks that reported a first token."""
    return [
        rank for rank, r in enumerate(results) if any(o.first_token_id >= 0 for o in r.outcomes)
    ]


@pytest.mark.parametrize(("cp", "tp"), [(1, 2), (1, 4), (2, 2)])
async def test_tp_ranks_equal_one_rank(
    pipeline, language_model, reference_runs, cp: int, tp: int
) -> None:
    decode = DecodePool(language_model.config)
    try:
        async with started_ranks(cp * tp, rank_init(tp_size=tp)) as ranks:
            heads = [d.kv_layout.head_start for d in ranks.descriptions]
            assert heads == [t * 2 // tp for t in range(tp)] * cp
            runner = Runner(pipeline, ranks, decode)
            for case in cases(pipeline):
                name = case.request.request_id
                want = reference_runs[name]
                got = await runner.run(case, block_tokens=16 if cp > 1 else 1)
                assert_equal_runs(got, want, f"{name} CP={cp} TP={tp}")
                [sampler] = sampled_by(got[4])  # one rank: the first of its TP group
                assert sampler % tp == 0, (name, sampler)
                got = await runner.run(case, chunk_tokens=13)
                assert_equal_runs(got, want, f"{name} CP={cp} TP={tp} chunked")
                if cp > 1:
                    got = await runner.run(case, solo_rank=cp - 1)
                    assert_equal_runs(got, want, f"{name} CP={cp} TP={tp} solo")
                    ran = [bool(r.outcomes) for r in got[4]]
                    assert ran == [False] * tp * (cp - 1) + [True] * tp
    finally:
        decode.close()
