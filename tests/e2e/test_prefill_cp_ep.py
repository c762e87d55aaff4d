"""Prefill's experts over its CP ranks through every service: ``stageserve up --prefill-cp 2
--prefill-ep 2`` on the tiny Qwen3-VL MoE (each prefill rank holds attention whole and half of
every MoE layer's experts, every batch CP-sharded) serves chats (text, an image, a second turn)
whose greedy output equals the one-process engine's.
"""

from __future__ import annotations

import pytest

from services.engine.offline import OfflinePipeline
from tests.e2e.system import openai_client, running_system
from tests.e2e.test_tensor_parallel import (
    MAX_TOKENS,
    MOE_DIR,
    cmdline,
    conversations,
    expected_text,
    rank_processes,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CP = "2"  # prefill's CP ranks, its experts split over them
FLAGS = (
    *("--prefill-cp", CP, "--prefill-ep", CP),
    *("--prefill-cp-min-tokens", "1", "--prefill-cp-block-tokens", "16"),
)


def test_experts_over_prefill_cp_ranks_match_the_engine(tmp_path) -> None:
    pipeline = OfflinePipeline.from_dir(MOE_DIR)
    cases = [(m, expected_text(pipeline, m, i)) for m, i in conversations()]
    with running_system(
        tmp_path, *("--model", str(MOE_DIR), "--num-pages", "512"), *FLAGS
    ) as system:
        client = openai_client(system)
        model = client.models.list().data[0].id
        for messages, expected in cases:
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            assert reply.choices[0].message.content == expected, messages
        pid = system.state["prefill"]["pid"]
        assert f"\0--ep\0{CP}\0" in cmdline(pid)
        assert len(rank_processes(pid)) == int(CP)
