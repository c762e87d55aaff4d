"""A free-running rank group of a real process: the rank steps by itself and reports unasked.

``TickStep`` (``tests.common.test_ranks_free:TickStep``) counts down the ticks posted to
it, one per step (it has work while ticks are left), fires a timer once it is due, raises
when a post asks, and echoes the values posted. Covered: reports with no step request (a
post's step, the steps its work takes, a timer's step), a step's error (the rank goes on),
a world of one with no rendezvous and no process group, and supervision: a rank SIGKILLed,
or frozen with SIGSTOP while busy (no report within ``step_timeout_s``) or idle (no Pong), is
reported down, killed, reaped and re-formed; posts sent to a rank that dies are lost with it,
never applied by the rank re-formed after it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import msgspec
import pytest
import torch.distributed as dist

from services.common.errors import CapacityError, UnavailableError
from services.common.ranks.config import StepSpec
from services.common.ranks.free_supervisor import Reported
from services.common.ranks.group import RankGroup
from services.common.ranks.step import FreeRankStep, RankContext
from tests.common.ranks_group_helpers import START_TIMEOUT_S, config, is_gone, wait_for
from tests.conftest import rank_children

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_env")]
TARGET = "tests.common.test_ranks_free:TickStep"
BOUND_S = 30.0  # generous bound on every wait for a report


class TickInit(msgspec.Struct, frozen=True):
    step_sleep_s: float = 0.0  # each step takes this long (a busy rank's pace)


class TickPayload(msgspec.Struct, frozen=True):
    value: int
    ticks: int = 0  # steps of work to add
    timer_s: float = 0.0  # > 0: a timer due this long after the post is applied
    is_failing: bool = False  # the step that applies it raises CapacityError


class TickResult(msgspec.Struct, frozen=True):
    step: int
    values: tuple[int, ...]  # of the posts this step applied
    ticks_left: int
    num_fired: int  # timers fired so far
    pid: int
    has_process_group: bool  # torch.distributed initialized in the rank, or a group given it


class TickStep(FreeRankStep):
    init_type = TickInit
    payload_type = TickPayload
    result_type = TickResult

    def __init__(self, ctx: RankContext, init: TickInit) -> None:
        self.step_sleep_s = init.step_sleep_s
        self.has_process_group = dist.is_initialized() or ctx.cpu_group is not None
        self.ticks = 0
        self.due_mono = math.inf
        self.num_fired = 0

    def run_step(self, step: int, payloads: list[TickPayload]) -> TickResult:
        for payload in payloads:
            if payload.is_failing:
                raise CapacityError(f"post {payload.value} asked to fail")
            self.ticks += payload.ticks
            if payload.timer_s > 0:
                self.due_mono = time.monotonic() + payload.timer_s
        if self.ticks:
            self.ticks -= 1
            time.sleep(self.step_sleep_s)
        if time.monotonic() >= self.due_mono:
            self.due_mono, self.num_fired = math.inf, self.num_fired + 1
        values = tuple(p.value for p in payloads)
        return TickResult(
            step, values, self.ticks, self.num_fired, os.getpid(), self.has_process_group
        )

    def has_work(self) -> bool:
        return self.ticks > 0

    def seconds_until_due(self) -> float:
        return self.due_mono - time.monotonic()


class Free:
    def __init__(self) -> None:
        self.reports: list[Reported] = []  # appended on the group's thread
        self.readiness: list[bool] = []
        self.group: RankGroup | None = None

    def results(self) -> list[TickResult]:
        return [r.result for r in self.reports if isinstance(r.result, TickResult)]

    async def wait_for_report(self, predicate) -> Reported:
        found: list[Reported] = []
        await wait_for(lambda: found.extend(filter(predicate, self.reports)) or found, BOUND_S)
        return found[0]


@contextlib.asynccontextmanager
async def free_group(init: TickInit = TickInit(), **overrides):
    settings = dict(is_free_running=True, step_timeout_s=2.0, liveness_timeout_s=2.0)
    settings.update(overrides)
    free = Free()
    group = free.group = RankGroup(
        config(("cpu",), **settings),
        StepSpec(TARGET, TickResult, init),
        on_ready_change=free.readiness.append,
        on_report=free.reports.append,
    )
    try:
        await group.start()
        yield free
    finally:
        await group.aclose()
        assert rank_children() == []


async def test_a_free_rank_reports_each_step_unasked_and_goes_on_after_a_failed_one() -> None:
    async with free_group() as free:
        first = await free.wait_for_report(lambda r: r.result is not None)  # after warm-up
        assert first.through_seq == 0 and first.result.values == ()
        seq = free.group.post(TickPayload(value=7, ticks=4))
        await wait_for(
            lambda: free.results()[-1].ticks_left == 0 and len(free.results()) > 4, BOUND_S
        )
        applied = [r for r in free.reports if r.result is not None and r.result.values]
        assert [(r.through_seq, r.result.values) for r in applied] == [(seq, (7,))]
        steps = [r.step for r in free.results()]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
        assert [r.ticks_left for r in free.results()][-4:] == [3, 2, 1, 0]  # no post asked

        timer_seq = free.group.post(TickPayload(value=8, timer_s=0.5))
        fired = await free.wait_for_report(lambda r: r.result is not None and r.result.num_fired)
        assert fired.through_seq == timer_seq and fired.result.values == ()  # the timer's own

        failing_seq = free.group.post(TickPayload(value=9, is_failing=True))
        failed = await free.wait_for_report(lambda r: r.error is not None)
        assert failed.through_seq == failing_seq and not failed.is_down
        assert isinstance(failed.error, CapacityError) and "post 9 asked" in failed.error.message
        after = await free.wait_for_report(
            lambda r: r.result is not None and r.through_seq == failing_seq
        )
        assert after.result.pid == first.result.pid and free.group.is_ready
        assert free.readiness == [True]


async def test_a_free_rank_meets_nobody_and_forms_no_process_group() -> None:
    """A world of one that runs no collective: no rendezvous store, no gloo world; so the
    rank process listens on no socket at all."""
    from tests.e2e.test_ports import listening_sockets

    async with free_group() as free:
        first = await free.wait_for_report(lambda r: r.result is not None)
        assert not first.result.has_process_group
        assert listening_sockets(first.result.pid) == []


async def test_posts_to_a_rank_that_dies_are_lost_with_it_never_applied_by_its_successor() -> None:
    """Posts sent to a frozen rank wait in its connection; with no report for them within
    ``step_timeout_s`` it is killed and they are reported lost. The rank re-formed after it (a
    new process, connection and formation) applies only the posts made to it."""
    async with free_group() as free:
        first = await free.wait_for_report(lambda r: r.result is not None)
        pid = first.result.pid
        os.kill(pid, signal.SIGSTOP)  # its connection stays open: the posts go to it
        seqs = [free.group.post(TickPayload(value=v)) for v in (1, 2, 3)]
        down = await free.wait_for_report(lambda r: r.is_down and r.through_seq == seqs[-1])
        assert "has work and sent no report" in down.error.message, down.error.message
        assert not any(r.values for r in free.results())  # none applied before it froze
        await wait_for(lambda: is_gone(pid), 10.0)
        await wait_for(lambda: free.group.is_ready, START_TIMEOUT_S)
        seq = free.group.post(TickPayload(value=4))
        await free.wait_for_report(lambda r: r.result is not None and r.through_seq == seq)
        successor = [r for r in free.results() if r.pid != pid]
        assert [v for r in successor for v in r.values] == [4]


async def test_a_free_rank_sigkilled_is_reported_down_and_reforms() -> None:
    async with free_group(TickInit(step_sleep_s=0.01)) as free:
        first = await free.wait_for_report(lambda r: r.result is not None)
        pid = first.result.pid
        seq = free.group.post(TickPayload(value=1, ticks=10**6))  # busy for good
        await free.wait_for_report(lambda r: r.through_seq == seq)
        os.kill(pid, signal.SIGKILL)
        down = await free.wait_for_report(lambda r: r.is_down)
        assert down.through_seq == seq and isinstance(down.error, UnavailableError)
        assert "exited with signal SIGKILL" in down.error.message
        again = await free.wait_for_report(lambda r: r.result is not None and r.result.pid != pid)
        assert again.result.values == () and free.readiness == [True, False, True]


@pytest.mark.parametrize("is_busy", [True, False], ids=["busy", "idle"])
async def test_a_frozen_free_rank_is_killed_and_reforms(is_busy: bool) -> None:
    """Busy, it sends no report within ``step_timeout_s``; idle, it answers no ping."""
    async with free_group(TickInit(step_sleep_s=0.01)) as free:
        first = await free.wait_for_report(lambda r: r.result is not None)
        pid = first.result.pid
        if is_busy:
            seq = free.group.post(TickPayload(value=1, ticks=10**6))
            await free.wait_for_report(lambda r: r.through_seq == seq)
        os.kill(pid, signal.SIGSTOP)  # on failure, the group's stop kills it
        frozen_at = time.monotonic()
        down = await free.wait_for_report(lambda r: r.is_down)
        assert time.monotonic() - frozen_at < BOUND_S
        expected = "has work and sent no report" if is_busy else "answered no ping"
        assert expected in down.error.message, down.error.message
        await wait_for(lambda: is_gone(pid), 10.0)  # killed and reaped, not left stopped
        await wait_for(lambda: free.group.is_ready, START_TIMEOUT_S)
        again = await free.wait_for_report(lambda r: r.result is not None and r.result.pid != pid)
        assert again.result.ticks_left == 0  # a fresh process
