"""Rank groups of real processes on CPU (gloo): results in order, agreed failures, a rank
SIGKILLed or SIGSTOPped mid-step (fail-stop, then the group re-forms and serves), and ranks
that cannot start. Every test ends with no rank process of this test process left running
or unreaped.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from services.common.errors import CapacityError, UnavailableError
from services.common.ranks.config import StepSpec
from services.common.ranks.errors import RankStartError, StepFailedError
from services.common.ranks.group import RankGroup
from tests.common.ranks_group_helpers import (
    START_TIMEOUT_S,
    config,
    is_gone,
    running,
    wait_for,
)
from tests.common.test_ranks_steps import TARGET, EchoInit, EchoPayload, EchoResult, Garbage
from tests.conftest import rank_children

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_env")]


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_steps_return_every_ranks_result_in_order_while_the_loop_runs(
    world_size: int,
) -> None:
    async with running(("cpu",) * world_size) as run:
        pids = run.group.rank_pids
        assert (
            len(set(pids)) == world_size and os.getpid() not in pids
        )  # R = 1 too: its own process
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.ensure_future(ticker())
        try:
            results = await asyncio.gather(
                *(run.group.step(EchoPayload(value=v, sleep_s=0.1)) for v in range(4))
            )
        finally:
            ticking.cancel()
        for i, per_rank in enumerate(results):
            assert [(r.step, r.rank, r.world_size) for r in per_rank] == [
                (i + 1, r, world_size) for r in range(world_size)
            ]
            assert {(r.value, r.device_total, r.cpu_total, r.num_executed) for r in per_rank} == {
                (i, i * world_size, i * world_size, i + 1)
            }
            assert tuple(r.pid for r in per_rank) == pids
        assert ticks >= 10  # four steps of >= 0.1 s each ran beside the ticker, not instead of it
        assert run.readiness == [True]
    assert all(is_gone(pid) for pid in pids)


async def test_the_ranks_listen_on_loopback_only() -> None:
    """Rank 0's TCPStore (and the gloo pairs) accept no connection from another host."""
    from tests.e2e.test_ports import is_loopback_only, listening_sockets

    async with running(("cpu", "cpu")) as run:
        found = {pid: listening_sockets(pid) for pid in run.group.rank_pids}
        assert found[run.group.rank_pids[0]], "rank 0 serves the group's TCPStore"
        exposed = {
            pid: [s for s in sockets if not is_loopback_only(s[0])]
            for pid, sockets in found.items()
        }
        assert not any(exposed.values()), exposed


async def test_a_rank_failing_mid_step_fails_it_alike_everywhere_and_the_next_step_runs() -> None:
    async with running(("cpu", "cpu"), heartbeat_s=0.5, leader_timeout_s=1.5) as run:
        with pytest.raises(StepFailedError) as caught:
            await run.group.step(EchoPayload(value=5, raise_on_rank=1))
        text = "step 1 failed on rank 1: RuntimeError: injected failure at value 5"
        assert caught.value.message == text
        after = await run.group.step(EchoPayload(value=1))
        assert [r.last_error for r in after] == [text, text]  # every rank was told the same text
        with pytest.raises(
            CapacityError,
            match=r"^step 3 failed on rank 0: CapacityError: injected: no pages left$",
        ):
            await run.group.step(EchoPayload(value=1, capacity_error_on_rank=0))
        with pytest.raises(
            StepFailedError, match=r"^step 4 failed on rank 0: malformed step payload: .*`value`"
        ):
            await run.group.step(
                Garbage(junk="not an EchoPayload")
            )  # a garbage payload: agreed, not fatal
        last = await run.group.step(EchoPayload(value=2))
        assert [(r.step, r.device_total, r.num_executed) for r in last] == [
            (5, 4, 4),
            (5, 4, 4),
        ]  # 4 never ran
        assert last[0].last_error.startswith("step 4 failed on rank 0: malformed step payload")
        # A step longer than leader_timeout_s (no pings while busy) does not orphan the ranks.
        await run.group.step(EchoPayload(value=1, sleep_s=2.0))
        assert [r.num_executed for r in await run.group.step(EchoPayload(value=1))] == [6, 6]
        assert run.group.is_ready and run.readiness == [True]


async def test_a_sigkilled_rank_fails_the_step_unavailable_and_the_group_reforms() -> None:
    async with running(("cpu", "cpu")) as run:
        old_pids = run.group.rank_pids
        start = asyncio.get_running_loop().time()
        with pytest.raises(
            UnavailableError,
            match=r"rank 1 \(cpu, pid \d+\) exited with signal SIGKILL during step 1",
        ):
            await run.group.step(EchoPayload(value=1, kill_on_rank=1))
        # the exit ended it, not the 3 s step deadline (whose error names the deadline)
        assert asyncio.get_running_loop().time() - start < 3.0 + 10.0
        assert run.readiness == [True, False] and not run.group.is_ready
        with pytest.raises(UnavailableError, match="re-forming after: rank 1"):
            await run.group.step(EchoPayload(value=1))
        await wait_for(
            lambda: all(is_gone(pid) for pid in old_pids), 10.0
        )  # rank 0 went down with it
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)
        assert run.readiness == [True, False, True]
        results = await run.group.step(EchoPayload(value=3))
        assert [(r.rank, r.device_total, r.num_executed) for r in results] == [(0, 6, 1), (1, 6, 1)]
        assert not set(r.pid for r in results) & set(old_pids)  # new processes


async def test_the_caller_of_a_failed_step_hears_only_once_every_rank_is_gone() -> None:
    """Rank 0 is still inside the step (it could be writing into a peer's memory) when rank 1
    dies: by the time the caller's future fails, rank 0 is killed and reaped too."""
    async with running(("cpu", "cpu")) as run:
        pids = run.group.rank_pids
        alive_when_failed: list[list[int]] = []
        future = run.group.submit(EchoPayload(value=1, kill_on_rank=1, sleep_s=5.0))
        # Runs in the thread that fails the future, at that very moment.
        future.add_done_callback(
            lambda _: alive_when_failed.append([p for p in pids if not is_gone(p)])
        )
        with pytest.raises(UnavailableError, match="rank 1"):
            await asyncio.wrap_future(future)
        assert alive_when_failed == [[]]


async def test_a_rank_whose_connections_close_before_it_exits_is_named_as_the_cause() -> None:
    """Rank 0's status exchange breaks on the lost connection before rank 1's exit shows:
    the step's error still names rank 1 and its exit, not rank 0's broken exchange."""
    async with running(("cpu", "cpu")) as run:
        with pytest.raises(
            UnavailableError, match=r"rank 1 \(cpu, pid \d+\) exited with code 7 during step 1"
        ):
            await run.group.step(EchoPayload(value=1, leave_on_rank=1))
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)


async def test_a_sigstopped_rank_fails_the_step_within_its_deadline_and_is_killed() -> None:
    async with running(("cpu", "cpu"), step_timeout_s=2.0, watchdog_s=0.5) as run:
        stopped_pid = run.group.rank_pids[1]
        start = asyncio.get_running_loop().time()
        step = asyncio.ensure_future(run.group.step(EchoPayload(value=1, stop_on_rank=1)))
        await wait_for(lambda: run.group.progress.is_stalled() or step.done(), 10.0)
        assert not step.done()  # the watchdogs see the stall first, before the deadline
        assert run.group.rank_progress[1].is_stalled()
        with pytest.raises(
            UnavailableError, match=r"did not finish step 1 within its 2.0 s deadline"
        ):
            await step
        assert 2.0 <= asyncio.get_running_loop().time() - start < 2.0 + 10.0
        assert run.readiness == [True, False]
        await wait_for(lambda: is_gone(stopped_pid), 10.0)  # killed and reaped, not leaked
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)
        assert [r.device_total for r in await run.group.step(EchoPayload(value=2))] == [4, 4]


@pytest.mark.parametrize(
    ("devices", "target", "init", "expected"),
    [
        (
            ("cpu", "cuda:3"),
            TARGET,
            EchoInit(),
            r"rank 1 \(cuda:3, pid \d+\) failed to start at device: RuntimeError: cuda:3: CUDA is "
            r"not available",
        ),
        (
            ("cpu", "cpu"),
            TARGET,
            EchoInit(fail_on_rank=1),
            r"rank 1 \(cpu, pid \d+\) failed to start at construct: MemoryError: injected out of "
            r"memory while loading",
        ),
        (
            ("cpu",),
            "tests.common.no_such_module:Step",
            EchoInit(),
            r"rank 0 \(cpu, pid \d+\) failed to start at import: ModuleNotFoundError: "
            r".*tests.common.no_such_module",
        ),
    ],
    ids=["bad-device", "constructor-raises", "import-error"],
)
async def test_a_rank_that_cannot_start_fails_the_start_naming_it(
    devices, target, init, expected
) -> None:
    readiness: list[bool] = []
    group = RankGroup(
        config(devices), StepSpec(target, EchoResult, init), on_ready_change=readiness.append
    )
    with pytest.raises(RankStartError, match=expected):
        await group.start()
    assert readiness == [] and group.state.value == "stopped"
    assert rank_children() == []
