"""Context-parallel prefill over C = 2 and 3 rank processes equals C = 1: first-token logits
within 1e-4 (fp32) and decode's KV pages, for text, one and two images, an image across
shard boundaries, lengths not divisible by C·B, chunked passes, and a plan one rank runs
alone. One group per C serves every case (block sizes 1 and 16 are per plan).
"""

from __future__ import annotations

import time

import pytest
import torch

from services.common.types import SamplingParams
from services.prefill.messages import RankRequest
from tests.prefill.conftest import make_case, standard_cases
from tests.prefill.cp_ranks import DecodePool, plan_of, started_ranks, write_rows

pytestmark = pytest.mark.slow
LOGITS_ATOL = 1e-4
KV_ATOL = 1e-5


def cases(pipeline) -> list:
    params = SamplingParams(temperature=0.0)
    long_text = "Tell me a long story about the sea, the wind, the boats and the birds. " * 3
    return [
        *standard_cases(pipeline, params),
        make_case(pipeline, "long-text", long_text, [], params),
    ]


class Runner:
    """Runs cases as RankRequests on a group; returns (logits, k, v, first token, results)."""

    def __init__(self, pipeline, ranks, decode: DecodePool) -> None:
        self.pipeline, self.ranks, self.decode = pipeline, ranks, decode
        self.num_plans = 0

    async def run(self, case, **plan_kwargs):
        [run] = await self.run_batch([case], **plan_kwargs)
        return run

    async def run_batch(self, batch, **plan_kwargs) -> list:
        """Every case of ``batch`` as a request of one plan; one run per case."""
        requests: list[RankRequest] = []
        row_start = 7  # any window: every rank's buffer gets the rows at the same place
        try:
            for case in batch:
                requests.append(self._request(case, row_start))
                row_start += requests[-1].num_image_tokens
            self.num_plans += 1
            results = await self.ranks.run(plan_of(self.num_plans, requests, **plan_kwargs))
            return [_run_of(r, results, self.decode) for r in requests]
        finally:
            for r in requests:
                self.decode.free(r.kv_dst)

    def _request(self, case, row_start: int) -> RankRequest:
        request = case.request
        dst = self.decode.reserve(request.request_id, len(request.prompt_ids))
        if request.spans:
            embeds = self.pipeline.engine.image_embeddings([request])[0]
            write_rows(self.ranks.descriptions, request.request_id, row_start, embeds.float())
        return RankRequest(
            request.request_id,
            tuple(request.prompt_ids),
            case.prompt.spans,
            request.params,
            dst,
            time.time() + 60,
            row_start if request.spans else -1,
        )


def _run_of(request: RankRequest, results, decode: DecodePool):
    [(logits, token)] = [
        (r.logits[request.request_id], o.first_token_id)
        for r in results
        for o in r.outcomes
        if o.request_id == request.request_id and o.first_token_id >= 0
    ]  # exactly one rank sampled it
    k, v = decode.kv(request.kv_dst, request.num_tokens)
    return torch.tensor(logits), k.clone(), v.clone(), token, results


async def references(pipeline, language_model, init=None) -> dict:
    """One rank's run of every case (``init``: the ranks' ``PrefillRankInit``)."""
    decode = DecodePool(language_model.config)
    try:
        async with started_ranks(1, init) as ranks:
            runner = Runner(pipeline, ranks, decode)
            return {case.request.request_id: await runner.run(case) for case in cases(pipeline)}
    finally:
        decode.close()


@pytest.fixture(scope="module")
def reference_runs(pipeline, language_model):
    import asyncio

    return asyncio.run(references(pipeline, language_model))


def assert_equal_runs(got, want, what: str) -> None:
    logits, k, v, token, _ = got
    ref_logits, ref_k, ref_v, ref_token, _ = want
    assert token == ref_token, what
    assert (logits - ref_logits).abs().max() <= LOGITS_ATOL, (
        what,
        (logits - ref_logits).abs().max(),
    )
    assert ref_k.abs().amax() > 0
    assert torch.allclose(k, ref_k, atol=KV_ATOL, rtol=0), (what, (k - ref_k).abs().max())
    assert torch.allclose(v, ref_v, atol=KV_ATOL, rtol=0), (what, (v - ref_v).abs().max())


async def test_one_rank_equals_the_offline_engine(pipeline, reference_runs) -> None:
    from tests.prefill.conftest import reference

    for case in cases(pipeline):
        ref = reference(pipeline, case)
        _, k, v, token, _ = reference_runs[case.request.request_id]
        assert token == ref.first_token_id, case.request.request_id
        assert torch.allclose(k, ref.k, atol=KV_ATOL, rtol=0)
        assert torch.allclose(v, ref.v, atol=KV_ATOL, rtol=0)


@pytest.mark.parametrize("num_ranks", [2, 3])
async def test_cp_ranks_equal_one_rank(
    pipeline, language_model, reference_runs, num_ranks: int
) -> None:
    decode = DecodePool(language_model.config)
    try:
        async with started_ranks(num_ranks) as ranks:
            runner = Runner(pipeline, ranks, decode)
            for case in cases(pipeline):
                name, n = case.request.request_id, len(case.request.prompt_ids)
                want = reference_runs[name]
                for block_tokens in (1, 16):
                    assert n % (num_ranks * block_tokens) or block_tokens == 1, (
                        "lengths must not divide"
                    )
                    got = await runner.run(case, block_tokens=block_tokens)
                    assert_equal_runs(got, want, f"{name} C={num_ranks} B={block_tokens}")
                    assert sum(bool(r.outcomes) for r in got[4]) == num_ranks  # every rank ran it
                got = await runner.run(case, block_tokens=16, chunk_tokens=13)
                assert_equal_runs(got, want, f"{name} C={num_ranks} chunked")
                got = await runner.run(case, solo_rank=num_ranks - 1)
                assert_equal_runs(got, want, f"{name} solo on the last rank")
                assert [bool(r.outcomes) for r in got[4]] == [False] * (num_ranks - 1) + [True]
    finally:
        decode.close()
