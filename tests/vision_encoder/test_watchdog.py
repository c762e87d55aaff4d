"""Readiness: a batch stuck on a rank turns health NOT_SERVING until it ends; an idle encoder
stays SERVING; SERVING while at least one rank serves; a recovered watchdog never reports
SERVING for a rank that is re-forming."""

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

        await enc.hook(Delay(rank=0, seconds=2.0))
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
    gate = ReadinessGate(health, num_ranks=1)
    loop_view, rank_view = gate.view(), gate.view(0)
    assert not health.is_serving
    gate.set_rank_ready(0, True)
    assert health.is_serving
    loop_view.set_serving(False)  # a stall
    rank_view.set_serving(False)
    assert not health.is_serving and not loop_view.is_serving
    loop_view.set_serving(True)
    assert not health.is_serving  # the other watchdog still holds
    gate.set_rank_ready(0, False)  # the group fail-stops meanwhile
    rank_view.set_serving(True)  # its watchdog recovers while the group re-forms
    assert not health.is_serving
    gate.set_rank_ready(0, True)
    assert health.is_serving
    health.enter_shutdown()
    gate.set_rank_ready(0, True)
    assert not health.is_serving and loop_view.is_shutting_down


def test_the_gate_serves_while_one_rank_serves_and_the_loop_holds_everything() -> None:
    health = HealthState()
    gate = ReadinessGate(health, num_ranks=2)
    loop_view, view_0, view_1 = gate.view(), gate.view(0), gate.view(1)
    gate.set_rank_ready(0, True)
    assert health.is_serving and view_0.is_serving and not view_1.is_serving  # 1 still forms
    gate.set_rank_ready(1, True)
    view_0.set_serving(False)  # rank 0 stalls: rank 1 serves
    assert health.is_serving and not view_0.is_serving and view_1.is_serving
    gate.set_rank_ready(1, False)  # rank 1 fail-stops too: nobody serves
    assert not health.is_serving
    gate.set_rank_ready(1, True)
    view_0.set_serving(True)
    assert health.is_serving
    loop_view.set_serving(False)  # the batch loop stalls: no rank's readiness helps
    assert not health.is_serving and view_0.is_serving and view_1.is_serving
    loop_view.set_serving(True)
    assert health.is_serving
