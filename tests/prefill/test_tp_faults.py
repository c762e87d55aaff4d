"""Faults in a tensor-parallel prefill group (TP = 2, real processes, gloo) behind the service.

A rank raising mid-forward leaves its peer waiting in the layer's all-reduce: the step fails at
the caller (an agreed error, a rank leaving the group or the step's deadline), and since the
group's collectives are out of step it re-forms with new processes and serves right. A rank
SIGSTOPped mid-forward is declared dead at the step's deadline; one SIGKILLed mid-forward is
seen at once. Either way the group re-forms and every local page is free again.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.common.errors import UnavailableError
from tests.prefill.conftest import standard_cases, stop_harness
from tests.prefill.group_faults import failed_prefill, serves_right, start_two_ranks, text_case

pytestmark = pytest.mark.slow
STEP_TIMEOUT_S = 4.0
REFORM_S = 120.0  # two torch imports and model loads on a loaded 2-core machine


async def started(pipeline, language_model, step_timeout_s: float = STEP_TIMEOUT_S, **group):
    return await start_two_ranks(pipeline, language_model, step_timeout_s, tp=2, **group)


async def serves_again(h, pipeline, old_pids: list[int]) -> None:
    """Re-formed (new processes, SERVING), right on the next prompt, every page free."""
    async with asyncio.timeout(REFORM_S):
        while not (h.health.is_serving and set(h.app.ranks.rank_pids).isdisjoint(old_pids)):
            await asyncio.sleep(0.05)
    await serves_right(h, pipeline, standard_cases(pipeline)[1:2])  # an image
    h.assert_all_free()


def request(pipeline, name: str):
    return text_case(pipeline, name, "Hi there, how are you?")


async def test_a_rank_raising_mid_forward_fails_the_step_and_the_group_re_forms(
    pipeline, language_model
) -> None:
    # the peer waits in the layer's all-reduce: its collective's timeout, the raising rank's
    # status exchange or the step's deadline ends the step, whichever comes first, and the
    # group re-forms (its collectives are out of step; never a step on a broken group)
    h = await started(pipeline, language_model, step_timeout_s=30.0, collective_timeout_s=5.0)
    try:
        pids = h.app.ranks.rank_pids
        _, dst = await failed_prefill(h, request(pipeline, "raise-r1-l1"))
        assert not h.decode.is_written(dst)
        await serves_again(h, pipeline, pids)
    finally:
        await stop_harness(h)


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_a_rank_lost_mid_forward_fails_the_request_and_the_group_re_forms(
    pipeline, language_model, how: str
) -> None:
    h = await started(pipeline, language_model)
    try:
        pids = h.app.ranks.rank_pids
        task = asyncio.ensure_future(h.prefill(request(pipeline, "stop-r1")))
        if how == "kill":  # the rank stops itself in layer 1: kill it there
            victim = pids[1]
            async with asyncio.timeout(30):
                while open(f"/proc/{victim}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
                    await asyncio.sleep(0.02)
            os.kill(victim, signal.SIGKILL)
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(task, STEP_TIMEOUT_S + 30)
        await serves_again(h, pipeline, pids)
    finally:
        await stop_harness(h)
