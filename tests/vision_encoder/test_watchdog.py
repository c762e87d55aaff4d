"""Progress watchdog: an engine thread stuck in a batch turns health NOT_SERVING; it recovers after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.clients.vision_encoder import SpanStatus
from tests.conftest import count_progress_checks, image_bytes
from tests.vision_encoder.conftest import gate_worker, running_encoder, span_input

WAIT_S = 30.0


async def wait_until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_stuck_batch_flips_readiness_until_it_ends(vision_model, image_processor) -> None:
    async with running_encoder(vision_model, watchdog_s=0.05) as enc:
        def stalled() -> float | None:
            return enc.registry.get_sample_value("stageserve_vision_encoder_stalled")

        release, batches = gate_worker(enc)
        assert enc.health.is_serving
        span = span_input(image_processor, image_bytes(56, 56, seed=1), 0)
        dst = enc.receiver.destination("held", 0, span.span.length)
        task = asyncio.create_task(enc.client.encode("held", [span], dst, WAIT_S))
        await wait_until(lambda: bool(batches))
        await wait_until(lambda: not enc.health.is_serving)
        assert stalled() == 1
        release()
        results = await task
        assert [r.status for r in results] == [SpanStatus.WRITTEN]
        await wait_until(lambda: enc.health.is_serving)
        await wait_until(lambda: stalled() == 0)
        assert batches == [["held"]]


async def test_an_idle_encoder_stays_serving(vision_model) -> None:
    async with running_encoder(vision_model, watchdog_s=0.05) as enc:
        polls = count_progress_checks(enc.app.leader.progress)
        await wait_until(lambda: polls[0] >= 20)  # many polls over several stall periods, no work
        assert enc.health.is_serving
        assert enc.registry.get_sample_value("stageserve_vision_encoder_stalled") == 0
