"""A free-running rank group of several real processes: rank 0 steps by itself, its followers
run its collectives (``FollowStep``, ``ranks_follow_step.py``).

Covered: every step's all-reduce proves every rank took part; idle followers answer pings,
and followers held in rank 0's long step are not declared dead; the whole group fail-stops
and re-forms (all new processes) when a follower is SIGKILLed, frozen with SIGSTOP while the
group has work (rank 0 blocks in its collective and sends no report) or while idle (no
Pong), when rank 0 is SIGKILLed and when a follower's ``follow`` raises; a step class with no
``follow`` cannot start a group of several.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from services.common.errors import CapacityError, UnavailableError
from services.common.ranks.config import StepSpec
from services.common.ranks.errors import RankStartError
from services.common.ranks.free_supervisor import Reported
from services.common.ranks.group import RankGroup
from tests.common.ranks_follow_step import (
    TARGET,
    FollowInit,
    FollowPayload,
    FollowResult,
)
from tests.common.ranks_group_helpers import START_TIMEOUT_S, config, is_gone, wait_for
from tests.common.test_ranks_free import TARGET as TICK_TARGET
from tests.common.test_ranks_free import TickInit, TickResult
from tests.conftest import rank_children

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_env")]
BOUND_S = 30.0  # generous bound on every wait for a report
BUSY = FollowPayload(value=1, ticks=10**6)  # the group steps for good


class Followed:
    def __init__(self) -> None:
        self.reports: list[Reported] = []  # appended on the group's thread
        self.readiness: list[bool] = []
        self.group: RankGroup | None = None

    def results(self) -> list[FollowResult]:
        return [r.result for r in self.reports if isinstance(r.result, FollowResult)]

    async def wait_for_report(self, predicate) -> Reported:
        found: list[Reported] = []
        await wait_for(lambda: found.extend(filter(predicate, self.reports)) or found, BOUND_S)
        return found[0]

    async def first_result(self) -> FollowResult:
        return (await self.wait_for_report(lambda r: r.result is not None)).result

    async def reformed(self, old_pids: tuple[int, ...]) -> FollowResult:
        """Once every old process is gone and a new formation reported: its first result."""
        await wait_for(lambda: all(is_gone(pid) for pid in old_pids), 10.0)
        await wait_for(lambda: self.group.is_ready, START_TIMEOUT_S)
        assert not set(old_pids) & set(self.group.rank_pids)
        assert len(self.group.rank_pids) == len(old_pids)
        again = await self.wait_for_report(
            lambda r: r.result is not None and r.result.pid not in old_pids
        )
        return again.result


def rank_sum(num_ranks: int) -> int:
    return num_ranks * (num_ranks + 1) // 2


@contextlib.asynccontextmanager
async def followed(num_ranks: int, init: FollowInit = FollowInit(), **overrides):
    settings = dict(
        is_free_running=True,
        step_timeout_s=2.0,
        liveness_timeout_s=2.0,
        collective_timeout_s=60.0,  # a rank blocked in a collective hangs past step_timeout_s
    )
    settings.update(overrides)
    run = Followed()
    group = run.group = RankGroup(
        config(("cpu",) * num_ranks, **settings),
        StepSpec(TARGET, FollowResult, init),
        on_ready_change=run.readiness.append,
        on_report=run.reports.append,
    )
    try:
        await group.start()
        yield run
    finally:
        await group.aclose()
        assert rank_children() == []


@pytest.mark.parametrize("num_ranks", [2, 3])
async def test_every_rank_of_a_free_group_takes_part_in_each_step(num_ranks: int) -> None:
    from tests.e2e.test_ports import is_loopback_only, listening_sockets

    async with followed(num_ranks) as run:
        first = await run.first_result()  # after warm-up, unasked
        assert first.values == () and first.pid == run.group.rank_pids[0]
        assert first.has_process_group and first.num_warmed_up == num_ranks
        sockets = [listening_sockets(pid) for pid in run.group.rank_pids]
        assert all(is_loopback_only(address) for found in sockets for address, _ in found)
        seq = run.group.post(FollowPayload(value=7, ticks=3))
        await wait_for(
            lambda: run.results()[-1].ticks_left == 0 and len(run.results()) > 3, BOUND_S
        )
        applied = [r for r in run.reports if r.result is not None and r.result.values]
        assert [(r.through_seq, r.result.values) for r in applied] == [(seq, (7,))]
        results = run.results()
        assert [r.step for r in results] == list(range(first.step, first.step + len(results)))
        for number, result in enumerate(results, start=1):  # each follower ran each step once
            assert result.rank_sum == rank_sum(num_ranks)
            assert result.num_followed == (num_ranks - 1) * number

        failing_seq = run.group.post(FollowPayload(value=8, failing_rank=0))
        failed = await run.wait_for_report(lambda r: r.error is not None)
        assert failed.through_seq == failing_seq and not failed.is_down
        assert isinstance(failed.error, CapacityError)
        seq = run.group.post(FollowPayload(value=9))
        after = await run.wait_for_report(lambda r: r.through_seq == seq)
        assert after.result.values == (9,) and after.result.rank_sum == rank_sum(num_ranks)
        assert run.readiness == [True] and after.result.pid == first.pid


async def test_idle_followers_answer_pings_and_busy_ones_need_not() -> None:
    """Idle, every rank answers pings for several liveness periods; held in rank 0's step past
    the liveness bound, followers are governed by the step deadline only."""
    liveness_s = 1.5
    async with followed(
        2, heartbeat_s=0.25, liveness_timeout_s=liveness_s, step_timeout_s=10.0
    ) as run:
        first = await run.first_result()
        seq = run.group.post(FollowPayload(value=1, hold_s=2 * liveness_s))
        held = await run.wait_for_report(lambda r: r.through_seq == seq)
        assert held.result.rank_sum == 3 and held.result.num_followed == 2
        pids = run.group.rank_pids
        await asyncio.sleep(3 * liveness_s)  # idle for three liveness periods
        assert run.readiness == [True] and run.group.rank_pids == pids
        seq = run.group.post(FollowPayload(value=2))
        after = await run.wait_for_report(lambda r: r.through_seq == seq)
        assert after.result.pid == first.pid and after.result.num_followed == 3


async def test_a_sigkilled_follower_fails_the_whole_group_and_it_reforms() -> None:
    """Posts sent to a frozen rank 0 are lost when its follower dies: the group fail-stops once,
    naming the follower, and all three processes are replaced."""
    async with followed(3, step_timeout_s=BOUND_S) as run:
        await run.first_result()
        pids = run.group.rank_pids
        os.kill(pids[0], signal.SIGSTOP)  # the posts wait in its connection
        seqs = [run.group.post(FollowPayload(value=v)) for v in (1, 2, 3)]
        os.kill(pids[2], signal.SIGKILL)
        down = await run.wait_for_report(lambda r: r.is_down)
        assert down.through_seq == seqs[-1] and isinstance(down.error, UnavailableError)
        assert f"rank 2 (cpu, pid {pids[2]}) exited with signal SIGKILL" in down.error.message
        again = await run.reformed(pids)
        assert again.values == () and again.rank_sum == rank_sum(3)
        assert not any(r.values for r in run.results())  # the lost posts were never applied
        assert sum(r.is_down for r in run.reports) == 1 and run.readiness == [True, False, True]


@pytest.mark.parametrize("is_busy", [True, False], ids=["busy", "idle"])
async def test_a_frozen_follower_fails_the_whole_group_and_it_reforms(is_busy: bool) -> None:
    """Busy, rank 0 blocks in the collective the follower never joins and sends no report
    within ``step_timeout_s``; idle, the follower answers no ping."""
    async with followed(2, FollowInit(step_sleep_s=0.05)) as run:
        await run.first_result()
        pids = run.group.rank_pids
        if is_busy:
            seq = run.group.post(BUSY)
            await run.wait_for_report(lambda r: r.through_seq == seq)
        os.kill(pids[1], signal.SIGSTOP)  # on failure, the group's stop kills it
        down = await run.wait_for_report(lambda r: r.is_down)
        if is_busy:
            expected = f"rank 0 (cpu, pid {pids[0]}) has work and sent no report"
        else:
            expected = f"rank 1 (cpu, pid {pids[1]}) answered no ping"
        assert expected in down.error.message, down.error.message
        again = await run.reformed(pids)
        assert again.ticks_left == 0 and again.rank_sum == 3  # a fresh group


async def test_a_sigkilled_rank_0_fails_the_whole_group_and_it_reforms() -> None:
    async with followed(2) as run:
        await run.first_result()
        pids = run.group.rank_pids
        os.kill(pids[0], signal.SIGKILL)
        down = await run.wait_for_report(lambda r: r.is_down)
        assert f"rank 0 (cpu, pid {pids[0]}) exited with signal SIGKILL" in down.error.message
        again = await run.reformed(pids)
        assert again.rank_sum == 3


async def test_a_follower_whose_follow_raises_fails_the_whole_group_and_it_reforms() -> None:
    """The follower leaves BROKEN; rank 0's collective breaks and it leaves too (its step
    class's ``on_failed`` raises): the group is re-formed."""
    async with followed(2) as run:
        await run.first_result()
        pids = run.group.rank_pids
        run.group.post(FollowPayload(value=1, failing_rank=1))
        down = await run.wait_for_report(lambda r: r.is_down)
        assert "exited with code 1" in down.error.message, down.error.message
        again = await run.reformed(pids)
        assert again.rank_sum == 3
        assert not any(r.values for r in run.results())


async def test_a_step_class_without_follow_cannot_start_a_free_group_of_several() -> None:
    group = RankGroup(
        config(("cpu", "cpu"), is_free_running=True),
        StepSpec(TICK_TARGET, TickResult, TickInit()),
        on_report=lambda reported: None,
    )
    with pytest.raises(RankStartError, match=r"failed to start at import: .*has no follow"):
        await group.start()
    assert rank_children() == []
