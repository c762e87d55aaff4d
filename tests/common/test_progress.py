"""ProgressWatchdog on a fake clock: stall detection, readiness it takes and gives back, the gauge."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from services.common import telemetry
from services.common.progress import ProgressWatchdog
from services.common.server import HealthState

STALL_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Loop:
    """What the watchdog watches: pending work and liveness, set by the test."""

    def __init__(self) -> None:
        self.is_pending = False
        self.is_alive = True


def make(
    loop: Loop, clock: FakeClock, registry: CollectorRegistry | None = None
) -> ProgressWatchdog:
    gauge = (
        telemetry.gauge("test_stalled", "stalled", registry=registry)
        if registry is not None
        else None
    )
    return ProgressWatchdog(
        "test",
        STALL_S,
        lambda: loop.is_pending,
        is_alive=lambda: loop.is_alive,
        clock=clock,
        stalled_gauge=gauge,
    )


def ready_health() -> HealthState:
    health = HealthState()
    health.set_serving(True)
    return health


def test_stalled_only_with_work_pending_and_no_tick() -> None:
    loop, clock = Loop(), FakeClock()
    watchdog = make(loop, clock)
    clock.now_s += 3 * STALL_S
    assert not watchdog.is_stalled()  # idle for long: not a stall
    loop.is_pending = True
    clock.now_s += STALL_S
    assert not watchdog.is_stalled()  # exactly stall_s since the last idle moment
    clock.now_s += 1
    assert watchdog.is_stalled()
    watchdog.tick()
    assert not watchdog.is_stalled()
    clock.now_s += STALL_S / 2
    watchdog.tick()
    clock.now_s += STALL_S / 2 + 1
    assert not watchdog.is_stalled()  # ticks keep it healthy however long the work lasts
    clock.now_s += STALL_S
    assert watchdog.is_stalled()


def test_a_dead_loop_is_stalled_even_when_idle() -> None:
    loop, clock = Loop(), FakeClock()
    watchdog = make(loop, clock)
    loop.is_alive = False
    assert watchdog.is_stalled() and not watchdog.is_healthy()


async def test_check_takes_readiness_while_stalled_and_gives_it_back() -> None:
    loop, clock, registry = Loop(), FakeClock(), CollectorRegistry()
    watchdog, health = make(loop, clock, registry), ready_health()

    def stalled_gauge() -> float | None:
        return registry.get_sample_value("stageserve_test_stalled")

    watchdog.check(health)
    assert health.is_serving and stalled_gauge() == 0
    loop.is_pending = True
    clock.now_s += STALL_S + 1
    watchdog.check(health)
    assert not health.is_serving and stalled_gauge() == 1
    watchdog.tick()
    watchdog.check(health)
    assert health.is_serving and stalled_gauge() == 0


async def test_check_never_makes_an_unready_service_serving() -> None:
    loop, clock = Loop(), FakeClock()
    watchdog, health = make(loop, clock), HealthState()  # not ready yet (model loading)
    loop.is_pending = True
    clock.now_s += STALL_S + 1
    watchdog.check(health)
    watchdog.tick()
    watchdog.check(health)
    assert not health.is_serving


async def test_check_does_nothing_once_shutdown_began() -> None:
    loop, clock = Loop(), FakeClock()
    watchdog, health = make(loop, clock), ready_health()
    loop.is_pending = True
    clock.now_s += STALL_S + 1
    watchdog.check(health)
    health.enter_shutdown()
    watchdog.tick()
    watchdog.check(health)
    assert not health.is_serving


async def test_run_polls_until_shutdown() -> None:
    loop, clock = Loop(), FakeClock()
    watchdog, health = make(loop, clock), ready_health()
    task = asyncio.create_task(watchdog.run(health, interval_s=0.001))
    loop.is_pending = True
    clock.now_s += STALL_S + 1
    async with asyncio.timeout(10):
        while health.is_serving:
            await asyncio.sleep(0.001)
        watchdog.tick()
        while not health.is_serving:
            await asyncio.sleep(0.001)
        health.enter_shutdown()
        await task  # run returns once shutdown began


def test_a_stall_that_ends_while_the_owner_is_not_ready_gives_nothing_back() -> None:
    """Prefill's case: a stuck step takes readiness, the rank group is then failed and re-forms;
    the work ends (no stall) before the new group is ready: readiness stays with the owner."""
    loop, clock = Loop(), FakeClock()
    owner_ready = [True]
    watchdog = ProgressWatchdog(
        "test", STALL_S, lambda: loop.is_pending, may_serve=lambda: owner_ready[0], clock=clock
    )
    health = ready_health()
    loop.is_pending = True
    clock.now_s += STALL_S + 1
    watchdog.check(health)
    assert not health.is_serving
    owner_ready[0] = False  # the group is failed and re-forms
    loop.is_pending = False  # its work ended with it
    watchdog.check(health)
    assert not health.is_serving  # not given back: the group is not ready
    owner_ready[0] = True
    watchdog.check(health)
    assert not health.is_serving  # the watchdog holds nothing now: the owner serves itself
    health.set_serving(True)
    watchdog.check(health)
    assert health.is_serving
