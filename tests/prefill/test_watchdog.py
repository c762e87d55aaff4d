"""Progress watchdog: a rank worker stuck on a batch turns health NOT_SERVING; it recovers after."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from services.common.types import SamplingParams
from tests.conftest import count_progress_checks
from tests.prefill.conftest import (
    gate_worker,
    make_case,
    prefill_config,
    start_harness,
    stop_harness,
    wait_until,
)


def stalled() -> float | None:
    return REGISTRY.get_sample_value("stageserve_prefill_stalled")


async def test_a_stuck_worker_flips_readiness_until_it_moves_again(
    pipeline, language_model
) -> None:
    harness = await start_harness(pipeline, language_model, prefill_config(watchdog_s=0.05))
    try:
        release, plans = gate_worker(harness)
        assert harness.health.is_serving
        task = asyncio.create_task(
            harness.prefill(make_case(pipeline, "held", "Hi.", [], SamplingParams()))
        )
        await wait_until(lambda: bool(plans))
        await wait_until(lambda: not harness.health.is_serving)
        assert stalled() == 1
        release()
        result, _ = await task
        assert result.first_token_id >= 0
        await wait_until(lambda: harness.health.is_serving)
        await wait_until(lambda: stalled() == 0)
        harness.assert_all_free()
    finally:
        await stop_harness(harness)


async def test_an_idle_worker_stays_serving(pipeline, language_model) -> None:
    harness = await start_harness(pipeline, language_model, prefill_config(watchdog_s=0.05))
    try:
        polls = count_progress_checks(harness.app.leader.progress)
        await wait_until(lambda: polls[0] >= 20)  # many polls over several stall periods, no work
        assert harness.health.is_serving
    finally:
        await stop_harness(harness)
