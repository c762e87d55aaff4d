"""The prefill leader's drain (SIGTERM): no new request, the ones it holds (queued or in a
plan) run to their end, and the drain returns once none is left or its budget is spent
(``stop`` then fails the rest)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import UnavailableError
from services.common.types import SamplingParams
from tests.prefill.conftest import WAIT_S, gate_worker, make_case, wait_until

GREEDY = SamplingParams(temperature=0.0)


async def test_a_drain_refuses_new_requests_and_lets_held_ones_finish(pipeline, harness) -> None:
    release, plans = gate_worker(harness)
    held = asyncio.create_task(harness.prefill(make_case(pipeline, "held", "Hi.", [], GREEDY)))
    await wait_until(lambda: bool(plans))  # its plan waits before the ranks
    queued = asyncio.create_task(
        harness.prefill(make_case(pipeline, "queued", "Hello there.", [], GREEDY))
    )
    await wait_until(lambda: harness.scheduler.num_live == 2)
    drain = asyncio.create_task(harness.leader.drain(WAIT_S))
    await asyncio.sleep(0)  # the drain's first step: it refuses from here on
    late = make_case(pipeline, "late", "Too late.", [], GREEDY)
    with pytest.raises(UnavailableError, match="shutting down and takes no new requests"):
        await harness.prefill(late)
    assert not drain.done()
    release()
    for task in (held, queued):
        result, dst = await task
        assert result.first_token_id >= 0
        harness.decode.pages.free(list(dst.page_ids))
    async with asyncio.timeout(WAIT_S):
        await drain
    harness.assert_all_free()


async def test_a_drain_returns_when_its_budget_is_spent(pipeline, harness) -> None:
    release, plans = gate_worker(harness)
    held = asyncio.create_task(harness.prefill(make_case(pipeline, "held", "Hi.", [], GREEDY)))
    await wait_until(lambda: bool(plans))
    async with asyncio.timeout(WAIT_S):
        await harness.leader.drain(0.05)
    assert harness.scheduler.num_live == 1  # left for the stop to fail
    release()
    result, dst = await held
    harness.decode.pages.free(list(dst.page_ids))
    assert result.first_token_id >= 0
