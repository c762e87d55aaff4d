"""Faults in a CP rank group behind the prefill service (C = 2, real processes, gloo).

A rank raising mid-forward: one error text at the caller and on every rank, no KV byte in
decode's pages, the next request right. A rank SIGSTOPped mid-forward: the step's deadline
declares it dead, the service turns NOT_SERVING, the group re-forms (new processes) and serves.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import UnavailableError
from tests.prefill.conftest import make_case, standard_cases, stop_harness
from tests.prefill.group_faults import failed_prefill, serves_right, start_two_ranks, text_case

pytestmark = pytest.mark.slow
STEP_TIMEOUT_S = 4.0


async def last_errors(harness) -> list[str]:
    """Every rank's last agreed error, read through a Describe-free text prefill's results."""
    results = []
    step = harness.leader.ranks.step

    async def recording(payload, *args):
        out = await step(payload, *args)
        results.extend(out)
        return out

    harness.leader.ranks.step = recording
    try:
        case = standard_cases(harness.encoder.pipeline)[0]
        await harness.prefill(
            make_case(harness.encoder.pipeline, "probe", "Hi.", [], case.request.params)
        )
    finally:
        harness.leader.ranks.step = step
    return [r.last_error for r in results]


async def test_a_rank_raising_mid_forward_fails_the_step_everywhere_and_writes_nothing(
    pipeline, language_model
) -> None:
    h = await start_two_ranks(pipeline, language_model)
    try:
        case = text_case(pipeline, "raise-r1-l2", "What is in this picture?")
        error, dst = await failed_prefill(h, case)
        text = error.message
        assert "failed on rank 1: RuntimeError: injected failure in layer 2" in text, text
        # no rank wrote: the peer stopped at the poisoned gather
        assert not h.decode.is_written(dst)
        assert await last_errors(h) == [text, text]  # the same agreed text on every rank
        h.assert_all_free()
        await serves_right(h, pipeline, standard_cases(pipeline)[:2])  # the group serves on
    finally:
        await stop_harness(h)


async def test_a_stopped_rank_is_declared_dead_and_the_group_re_forms(
    pipeline, language_model
) -> None:
    h = await start_two_ranks(pipeline, language_model, STEP_TIMEOUT_S)
    try:
        pids = h.app.ranks.rank_pids
        serving: list[tuple[bool, float]] = []
        set_serving = h.leader.on_serving

        def record(is_serving: bool) -> None:
            serving.append((is_serving, time.monotonic()))
            set_serving(is_serving)

        h.leader.on_serving = record
        sent_at: list[float] = []
        step = h.leader.ranks.step

        async def timed(payload, *args):
            sent_at.append(time.monotonic())
            return await step(payload, *args)

        h.leader.ranks.step = timed
        with pytest.raises(UnavailableError, match="did not finish step"):
            await h.prefill(text_case(pipeline, "stop-r1", "Hi there."))
        assert serving and serving[0][0] is False
        assert (
            serving[0][1] - sent_at[0] <= STEP_TIMEOUT_S + 1.0
        )  # detected within the deadline + 1 s
        assert not h.health.is_serving
        async with asyncio.timeout(120):  # re-formed: new processes, described, SERVING
            while not h.health.is_serving:
                await asyncio.sleep(0.05)
        assert set(h.app.ranks.rank_pids).isdisjoint(pids)
        await serves_right(h, pipeline, standard_cases(pipeline)[1:2])
        h.assert_all_free()
    finally:
        await stop_harness(h)
