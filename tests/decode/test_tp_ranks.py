"""Tensor-parallel decode as processes: ``python -m services.decode --ranks D*T --tp T``, each DP
rank a group of T processes (TP rank 0 runs the batch, the others follow its forwards), KV
written by a stand-in prefill of every head into each TP rank's pool of its own heads.

Every request's tokens equal the offline engine's (greedy and seeded, text and images, D = 1
and 2); a reservation names every TP rank's pool; a follower or TP rank 0 SIGKILLed or
SIGSTOPped mid-stream ends that DP rank's requests with an error in bounded time while the other
DP rank's finish, and the group re-forms with new processes and serves again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.common.errors import UnavailableError
from services.common.types import SamplingParams
from services.engine.llm import EngineRequest
from tests.conftest import image_bytes
from tests.decode.conftest import prompt_of
from tests.decode.test_ranks import (
    BOUND_S,
    KEY,
    Decode,
    Prefill,
    all_running,
    chat_request,
    decode_process,
    generate,
    make_pipeline,
    resume,
    wait_idle,
)

pytestmark = pytest.mark.slow
TP = 2


@pytest.fixture(scope="module", params=[1, 2], ids=lambda d: f"D{d}xTP{TP}")
def decode(request, tmp_path_factory) -> Iterator[Decode]:
    log_path = tmp_path_factory.mktemp(f"decode-tp-d{request.param}") / "decode.log"
    flags = ("--tp", str(TP), "--transfer-backend", "shm", "--watchdog-s", "10")
    with decode_process(request.param * TP, log_path, *flags) as running:
        yield dataclasses.replace(running, num_ranks=request.param)


def tp_groups(decode: Decode) -> list[dict[int, int]]:
    """Each DP rank's processes, TP rank -> pid (a group's processes share a leader address)."""
    groups: dict[str, dict[int, int]] = {}
    for pid in decode.rank_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        leader, rank = argv[argv.index("--leader") + 1], int(argv[argv.index("--rank") + 1])
        groups.setdefault(leader, {})[rank] = pid
    return list(groups.values())


@pytest.fixture(scope="module")
def pipeline():
    return make_pipeline()


async def test_every_request_matches_the_offline_engine(decode, pipeline) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, seed=42, max_new_tokens=12, repetition_penalty=1.2
    )
    requests = [
        chat_request(pipeline, f"text-{i}", f"Tell me about boat {i}.", [], [greedy, seeded][i % 2])
        for i in range(2 * decode.num_ranks)
    ] + [
        chat_request(
            pipeline, "image", "What is in this picture?", [image_bytes(120, 80, seed=1)], greedy
        )
    ]
    prefill, client = Prefill(pipeline.engine), decode.client()
    try:
        kv_ref = await client.reserve("shape", prompt_of(5, 1), 0, greedy, time.time() + BOUND_S)
        pools = kv_ref.to_destinations()
        assert [d.layout.head_start for d in pools] == [0, 1]  # 2 KV heads, one per TP rank
        assert len({d.session_id for d in pools}) == TP and kv_ref.has_valid_mac(KEY)
        assert await client.abort("shape", "test", is_kv_written=True)
        results = await asyncio.gather(*(generate(client, prefill, r) for r in requests))
        for request, (tokens, reason, _) in zip(requests, results, strict=True):
            (expected,) = pipeline.engine.generate([request])
            assert (tokens, reason) == (expected.token_ids, expected.finish_reason.value), (
                request.request_id
            )
        assert {dp_rank for _, _, dp_rank in results} == set(range(decode.num_ranks))
        await wait_idle(decode, client)
    finally:
        await client.close()


@pytest.mark.parametrize("decode", [2], indirect=True, ids=[f"D2xTP{TP}"])
@pytest.mark.parametrize(
    ("victim", "how"),
    [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
    ids=["follower-killed", "rank0-killed", "follower-stopped"],
)
async def test_a_tp_process_lost_mid_stream_fails_its_dp_ranks_requests_and_it_re_forms(
    decode, pipeline, victim: int, how: signal.Signals
) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    requests = [
        EngineRequest(f"{how}-{victim}-{i}", prompt_of(5, 200 + i), params) for i in range(6)
    ]
    prefill, client = Prefill(pipeline.engine), decode.client()
    groups = tp_groups(decode)
    assert sorted(len(g) for g in groups) == [TP, TP]
    try:
        tasks = await all_running(client, prefill, requests)
        target = groups[0][victim]  # one DP rank's TP rank 0 or its follower
        os.kill(target, how)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), BOUND_S)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        finished = [o for o in outcomes if not isinstance(o, BaseException)]
        assert failed and finished, outcomes
        assert all(isinstance(o, UnavailableError) for o in failed), failed
        for tokens, reason, _ in finished:  # the other DP rank's streams are whole
            assert (len(tokens), reason) == (300, "length")
        assert len({dp_rank for _, _, dp_rank in finished}) == 1
        await wait_idle(decode, client)  # re-formed: serving again, its pool whole
        assert target not in decode.rank_pids() and len(decode.rank_pids()) == 2 * TP
        tokens, reason, _ = await generate(
            client, prefill, EngineRequest(f"after-{how}-{victim}", prompt_of(5, 1), params)
        )
        assert (len(tokens), reason) == (300, "length")
    finally:
        if how is signal.SIGSTOP:
            resume(target)
        await client.close()
