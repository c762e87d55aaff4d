"""Decode with DP attention as processes: ``python -m services.decode --ranks 2 --dp-attention``
(dense: the MLP split over the two DP ranks; MoE: ``--ep 2``, the experts split), each DP rank
with its own requests, pool and attention, every forward joined by both.

Every request's tokens equal the offline engine's (one rank): with one request (the other
rank runs idle steps), with batches of different sizes on the two ranks, greedy and seeded,
text and images. Health-check-sized requests in a storm, mixed with long streams, aborts and
expiring reservations (state local to one rank), never stall a step. A rank SIGKILLed or
SIGSTOPped mid-stream ends every request of both DP ranks (they share every forward) with
UNAVAILABLE in bounded time; the group re-forms and serves again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.common.errors import AbortedError, UnavailableError
from services.common.types import SamplingParams
from services.engine.llm import EngineRequest
from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.decode.conftest import PAGE_SIZE, prompt_of
from tests.decode.test_ranks import (
    BOUND_S,
    Decode,
    Prefill,
    all_running,
    chat_request,
    decode_process,
    generate,
    resume,
    wait_idle,
)

pytestmark = pytest.mark.slow
MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
MODELS = {"dense": (TINY_MODEL_DIR, ()), "moe": (MOE_DIR, ("--ep", "2"))}


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory) -> Iterator[tuple[Decode, OfflinePipeline]]:
    model_dir, flags = MODELS[request.param]
    log_path = tmp_path_factory.mktemp(f"decode-dpa-{request.param}") / "decode.log"
    pipeline = OfflinePipeline.from_dir(model_dir, page_size=PAGE_SIZE)
    args = ("--model", str(model_dir), "--dp-attention", "--transfer-backend", "shm", *flags)
    with decode_process(2, log_path, *args, "--watchdog-s", "10") as running:
        yield running, pipeline


async def run_all(decode: Decode, pipeline: OfflinePipeline, requests: list[EngineRequest]):
    prefill, client = Prefill(pipeline.engine), decode.client()
    try:
        return await asyncio.gather(*(generate(client, prefill, r) for r in requests))
    finally:
        await client.close()


def expect_offline(pipeline: OfflinePipeline, requests, results) -> None:
    for request, (tokens, reason, _) in zip(requests, results, strict=True):
        (expected,) = pipeline.engine.generate([request])
        assert (tokens, reason) == (expected.token_ids, expected.finish_reason.value), (
            request.request_id
        )


async def test_one_request_with_the_other_rank_idle(served) -> None:
    decode, pipeline = served
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    requests = [chat_request(pipeline, "alone", "Tell me about boats.", [], params)]
    results = await run_all(decode, pipeline, requests)
    expect_offline(pipeline, requests, results)
    client = decode.client()
    try:
        await wait_idle(decode, client)
    finally:
        await client.close()


async def test_batches_of_different_sizes_on_the_two_ranks(served) -> None:
    decode, pipeline = served
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=14)
    requests = [
        chat_request(pipeline, f"text-{i}", f"Tell me about ship {i}.", [], [greedy, seeded][i % 2])
        for i in range(4)
    ] + [
        chat_request(
            pipeline, "image", "What is in this picture?", [image_bytes(96, 64, seed=3)], greedy
        )
    ]
    results = await run_all(decode, pipeline, requests)
    expect_offline(pipeline, requests, results)
    assert {dp_rank for _, _, dp_rank in results} == {0, 1}


async def test_a_storm_of_short_requests_with_aborts_and_expiries_never_stalls(served) -> None:
    """Health-check-sized requests (one or two tokens) by the hundred next to long streams,
    streams aborted mid-way and reservations left to expire on one rank: each rank's queue,
    timers and pool differ all the time, and every request still ends with its own outcome
    within the bound."""
    decode, pipeline = served
    prefill, client = Prefill(pipeline.engine), decode.client()
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    short = [
        SamplingParams(temperature=0.0, max_new_tokens=1 + i % 2, ignore_eos=True) for i in range(2)
    ]
    try:
        streams = [
            asyncio.ensure_future(
                generate(client, prefill, EngineRequest(f"long-{i}", prompt_of(5, 40 + i), long))
            )
            for i in range(4)
        ]
        # reservations never started: their rank's expiry timer fires later (rank-local state)
        for i in range(3):
            await client.reserve(f"left-{i}", prompt_of(5, 7 + i), 0, long, time.time() + 2.0)
        checks = [
            EngineRequest(f"check-{i}", prompt_of(5, 3 + i % 50), short[i % 2]) for i in range(200)
        ]
        started = time.monotonic()
        ends = []
        for batch in range(0, len(checks), 25):
            ends += await asyncio.wait_for(
                asyncio.gather(*(generate(client, prefill, r) for r in checks[batch : batch + 25])),
                BOUND_S,
            )
            if batch == 0:  # abort two long streams mid-way
                for i in (0, 1):
                    assert await client.abort(f"long-{i}", "test", is_kv_written=True)
        assert all(
            len(tokens) == r.params.max_new_tokens
            for (tokens, _, _), r in zip(ends, checks, strict=True)
        )
        outcomes = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), BOUND_S)
        for i, outcome in enumerate(outcomes):
            if i < 2:  # aborted mid-way
                assert isinstance(outcome, AbortedError), outcome
            else:
                assert not isinstance(outcome, BaseException), outcome
                assert (len(outcome[0]), outcome[1]) == (400, "length")
        assert time.monotonic() - started < 4 * BOUND_S
        await wait_idle(decode, client)  # every page back, the expired reservations' too
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("victim", "how"),
    [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
    ids=["rank1-killed", "rank0-killed", "rank1-stopped"],
)
async def test_a_rank_lost_mid_stream_fails_every_request_and_the_group_re_forms(
    served, victim: int, how: signal.Signals
) -> None:
    decode, pipeline = served
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    requests = [
        EngineRequest(f"{how}-{victim}-{i}", prompt_of(5, 200 + i), params) for i in range(6)
    ]
    prefill, client = Prefill(pipeline.engine), decode.client()
    pids = rank_pids_by_rank(decode)
    assert sorted(pids) == [0, 1]
    target = pids[victim]
    try:
        tasks = await all_running(client, prefill, requests)
        os.kill(target, how)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), BOUND_S)
        assert all(isinstance(o, UnavailableError) for o in outcomes), outcomes
        await wait_idle(decode, client)  # re-formed: serving again, both pools whole
        assert target not in decode.rank_pids() and len(decode.rank_pids()) == 2
        after = [
            EngineRequest(f"after-{how}-{victim}-{i}", prompt_of(5, 3 + i), params)
            for i in range(2)
        ]
        results = await asyncio.gather(*(generate(client, prefill, r) for r in after))
        assert [(len(t), reason) for t, reason, _ in results] == [(300, "length")] * 2
    finally:
        if how is signal.SIGSTOP:
            resume(target)
        await client.close()


def rank_pids_by_rank(decode: Decode) -> dict[int, int]:
    out = {}
    for pid in decode.rank_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        out[int(argv[argv.index("--rank") + 1])] = pid
    return out
