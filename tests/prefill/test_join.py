"""A prefill CP rank that joins from another host (``stageserve join-rank``, on 127.0.0.2 as a
pod's IP): behind the gRPC service, a batch of text and image requests gives the offline
engine's first tokens and decode KV, as two spawned ranks do; the joined rank advertises its
own address to the transfer engines.

The service refuses shm for a group with 'join' devices (``test_join_flags``); this harness
builds its group directly, so the KV and embedding rows still travel over shm on this one host.
"""

from __future__ import annotations

import pytest

from services.common.envs import INTERNAL_TOKEN_ENV
from tests.common.ranks_group_helpers import TOKEN, agent_ranks, control_address, join_agent
from tests.prefill.conftest import (
    prefill_as_one_batch,
    prefill_config,
    reference,
    standard_cases,
    start_harness,
    stop_harness,
)
from tests.prefill.cp_ranks import rank_env
from tests.prefill.test_service import assert_matches

pytestmark = pytest.mark.slow
JOINED_HOST = "127.0.0.2"


async def test_a_joined_cp_rank_prefills_like_a_spawned_one(
    pipeline, language_model, monkeypatch
) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    leader = control_address()
    with join_agent(leader, JOINED_HOST, env=rank_env()) as agent:
        h = await start_harness(
            pipeline,
            language_model,
            prefill_config(devices=("cpu", "cpu")),
            devices=("cpu", "join"),
            control_addr=leader,
            host="127.0.0.1",
            internal_token=TOKEN,
        )
        try:
            assert len(agent_ranks(agent)) == 1 and len(h.app.ranks.rank_pids) == 1
            cases = standard_cases(pipeline)
            results, batch = await prefill_as_one_batch(h, pipeline, cases)
            assert sorted(batch) == sorted(c.request.request_id for c in cases)
            for case, result in zip(cases, results, strict=True):
                assert_matches(h, case, *result, reference(pipeline, case))
            assert set(h.encoder.num_destinations) == {2}  # image rows reached both ranks
            h.assert_all_free()
        finally:
            await stop_harness(h)
