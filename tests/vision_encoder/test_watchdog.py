"""Readiness: a batch stuck on a rank turns health NOT_SERVING until it ends; an idle encoder
stays SERVING; a recovered watchdog never reports SERVING for a group that is re-forming."""

from __future__ import annotations

import asyncio

import pytest

from services.common.clients.vision_encoder import SpanStatus
from services.common.server import HealthState
from services.vision_encoder.readiness import ReadinessGate
from tests.conftest import count_progress_checks, image_bytes
from tests.vision_encoder.conftest import serve_encoder, span_input, wait_until
from tests.vision_encoder.rank_hooks import Delay

WAIT_S = 30.0


@pytest.mark.slow
async def test_a_stuck_batch_flips_readiness_until_it_ends_and_idle_stays_serving(
    image_processor,
) -> None:
    with serve_encoder(1, watchdog_s=0.05) as enc:
        polls = count_progress_checks(enc.app.leader.progress)
        await wait_until(
            lambda: polls[0] >= 20, WAIT_S
        )  # many polls over several stall periods, no work
        assert enc.health.is_serving and enc.value("stalled") == 0

        await enc.on_loop(enc.app.group.step(Delay(rank=0, seconds=2.0)))
        span = span_input(image_processor, image_bytes(56, 56, seed=1), 0)
        prefill = enc.prefill()
        call = enc.encode("held", [span], prefill.destination("held", 0, span.span.length), WAIT_S)
        task = asyncio.ensure_future(call)
        await wait_until(lambda: not enc.health.is_serving, WAIT_S)
        await wait_until(lambda: enc.value("stalled") == 1, WAIT_S)  # the batch loop's own watchdog
        results = await task
        assert [r.status for r in results] == [SpanStatus.WRITTEN]
        await wait_until(lambda: enc.health.is_serving, WAIT_S)
        await wait_until(lambda: enc.value("stalled") == 0, WAIT_S)


def test_the_gate_serves_only_with_the_group_ready_and_no_watchdog_holding() -> None:
    health = HealthState()
    gate = ReadinessGate(health)
    loop_view, rank_view = gate.view(), gate.view()
    assert not health.is_serving
    gate.set_group_ready(True)
    assert health.is_serving
    loop_view.set_serving(False)  # a stall
    rank_view.set_serving(False)
    assert not health.is_serving and not loop_view.is_serving
    loop_view.set_serving(True)
    assert not health.is_serving  # the other watchdog still holds
    gate.set_group_ready(False)  # the group fail-stops meanwhile
    rank_view.set_serving(True)  # its watchdog recovers while the group re-forms
    assert not health.is_serving
    gate.set_group_ready(True)
    assert health.is_serving
    health.enter_shutdown()
    gate.set_group_ready(True)
    assert not health.is_serving and loop_view.is_shutting_down
