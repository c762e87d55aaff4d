"""The leader's side of a rank group driven by fake rank processes (``fake_rank.py``) that say
exactly what the test makes them say: a malformed frame, a stranger's messages, ranks that
exit at every re-form, a Hello with the wrong token, a stop while a step is in flight, and a
free-running group's follower that sends a Report."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.errors import UnavailableError
from services.common.ranks.errors import RankStartError, StepFailedError
from services.common.ranks.messages import (
    Hello,
    Ping,
    Post,
    Ready,
    Report,
    Setup,
    Shutdown,
    StepReply,
    StepStatus,
    encode_raw,
)
from tests.common.ranks_fake_helpers import TOKEN, WAIT_S, Stranger, Value, driven
from tests.common.ranks_group_helpers import wait_for

pytestmark = [pytest.mark.usefixtures("rank_env")]
SUPERVISOR = "services.common.ranks.supervisor"
STOP_GRACE_S = 30.0  # the fake ranks leave when told to, long before this


async def test_a_malformed_frame_from_a_rank_fails_that_step_and_the_leader_serves_on() -> None:
    async with driven() as run:
        await run.form()
        (rank,) = run.ranks
        future = run.group.submit(Value(1))
        request = await asyncio.to_thread(rank.next_step)
        rank.send_raw(b"\xff\x00 not msgpack")
        with pytest.raises(
            StepFailedError, match=r"^rank 0 sent a malformed control message during step 1: "
        ):
            await asyncio.wrap_future(future)
        rank.answer(request, Value(1))  # late: dropped, not taken for step 2
        future = run.group.submit(Value(2))
        request = await asyncio.to_thread(rank.next_step)
        assert request.step == 2
        rank.answer(request, Value(2))
        assert await asyncio.wrap_future(future) == [Value(2)]
        assert run.group.is_ready and run.readiness == [True]


async def test_messages_from_a_stranger_are_dropped_even_mid_step(caplog) -> None:
    """A peer that is no rank of the formation sends garbage, forged replies to the step in
    flight and a Hello as rank 0 (right token, formation and pid): all dropped or refused,
    and the step ends with the real rank's answer."""
    caplog.set_level(logging.WARNING, logger=SUPERVISOR)
    async with driven() as run:
        await run.form()
        (rank,) = run.ranks
        future = run.group.submit(Value(3))
        request = await asyncio.to_thread(rank.next_step)  # step 1 is in flight until answered
        stranger = Stranger(run.group.control_addr)
        try:
            stranger.send_raw(b"garbage")
            stranger.send(StepReply(step=1, rank=0, status=StepStatus.BROKEN, error="forged"))
            stranger.send(
                StepReply(step=1, rank=0, status=StepStatus.OK, result=encode_raw(Value(666)))
            )
            stranger.send(
                Hello(
                    rank=0,
                    world_size=1,
                    formation=rank.formation,
                    pid=rank.pid,
                    device="cpu",
                    store_port=0,
                    token=TOKEN,
                )
            )
            assert await asyncio.to_thread(stranger.receive) == Shutdown(step=1)
        finally:
            stranger.close()
        assert not future.done()
        rank.answer(request, Value(3))
        assert await asyncio.wrap_future(future) == [Value(3)]
        assert run.group.is_ready and run.readiness == [True]
    logged = [r.getMessage() for r in caplog.records if r.name == SUPERVISOR]
    assert logged[0].startswith("fake: dropped a malformed message from an unknown peer: ")
    assert logged[1:] == [
        "fake: dropped StepReply from an unknown peer",
        "fake: dropped StepReply from an unknown peer",
        f"fake: refused the Hello of rank 0 (pid {rank.pid}): the group is ready, not forming",
    ]


async def test_re_forms_are_bounded() -> None:
    """After a fail-stop, every re-formed formation's rank exits at start: after
    ``max_restart_attempts`` (2) such re-forms the group is FAILED and spawns no more."""
    async with driven(max_restart_attempts=2) as run:
        await run.form()
        (rank,) = run.ranks
        future = run.group.submit(Value(1))
        request = await asyncio.to_thread(rank.next_step)
        rank.send(StepReply(step=request.step, rank=0, status=StepStatus.BROKEN, error="gone"))
        with pytest.raises(UnavailableError, match=r"^fake: gone$"):
            await asyncio.wrap_future(future)
        for formation in (2, 3):
            (starting,) = await run.spawned()
            assert starting.formation == formation
            starting.exit(3)
        await wait_for(lambda: run.group.state.value == "failed", WAIT_S)
        assert not run.puppets.has_announced()  # no fourth formation
        assert run.group.rank_pids == () and run.readiness == [True, False]
        with pytest.raises(
            UnavailableError,
            match=r"failed for good after: rank 0 \(cpu, pid \d+\) exited during start-up with "
            r"code 3$",
        ):
            await run.group.step(Value(2))


@pytest.mark.slow  # the start waits out start_timeout_s
async def test_a_hello_with_the_wrong_token_is_refused(caplog) -> None:
    caplog.set_level(logging.WARNING, logger=SUPERVISOR)
    async with driven(start_timeout_s=5.0) as run:
        start = asyncio.ensure_future(run.group.start())
        (impostor,) = await run.spawned()
        impostor.hello(token="guess")
        assert isinstance(await asyncio.to_thread(impostor.receive), Shutdown)
        with pytest.raises(RankStartError, match=r"no Hello from ranks \[0\]"):
            await start
        assert run.readiness == [] and run.group.state.value == "stopped"
    refusals = [r.getMessage() for r in caplog.records if "refused the Hello" in r.getMessage()]
    assert refusals == [
        f"fake: refused the Hello of rank 0 (pid {impostor.pid}): its internal token does not match"
    ]


async def test_stop_fails_the_step_in_flight_and_tells_ranks_to_leave() -> None:
    async with driven(2, stop_grace_s=STOP_GRACE_S) as run:
        await run.form()
        future = run.group.submit(Value(1))
        for rank in run.ranks:
            await asyncio.to_thread(rank.next_step)  # never answered
        closing = asyncio.ensure_future(run.group.aclose())
        for rank in run.ranks:
            assert isinstance(await asyncio.to_thread(rank.receive), Shutdown)
            rank.exit(0)
        await closing
        with pytest.raises(UnavailableError, match=r"^fake: the rank group is stopped$"):
            await asyncio.wait_for(asyncio.wrap_future(future), WAIT_S)  # failed, not left hanging
        with pytest.raises(UnavailableError, match="stopped"):
            await run.group.step(Value(2))
        assert run.readiness == [True, False]


async def test_a_free_group_posts_to_rank_0_pings_all_and_a_follower_s_report_fails_it() -> None:
    """Posts go to rank 0 only, Pings to every rank; only rank 0 reports, so a Report from
    a follower is malformed: the whole group fail-stops, naming it, and its posts are lost."""
    async with driven(2, is_free_running=True, heartbeat_s=0.2) as run:
        await run.form()
        rank_0, follower = run.ranks
        seq = run.group.post(Value(5))
        post = await asyncio.to_thread(rank_0.receive)
        assert isinstance(post, Post) and post.seq == seq
        for _ in range(2):  # a follower hears Pings, never a Post
            assert isinstance(await asyncio.to_thread(follower.receive, skip_pings=False), Ping)
        rank_0.send(
            Report(
                step=1,
                rank=0,
                num_posts=1,
                status=StepStatus.OK,
                has_work=False,
                result=encode_raw(Value(6)),
            )
        )
        await wait_for(lambda: len(run.reports) == 1, WAIT_S)
        assert run.reports[0].through_seq == seq and run.reports[0].result == Value(6)
        lost = run.group.post(Value(7))
        assert isinstance(await asyncio.to_thread(rank_0.receive), Post)  # never reported
        follower.send(Report(step=2, rank=1, num_posts=0, status=StepStatus.OK, has_work=False))
        await wait_for(lambda: len(run.reports) == 2, WAIT_S)  # once the ranks are gone
        down = run.reports[1]
        assert run.readiness == [True, False]
        assert down.is_down and down.through_seq == lost
        assert down.error.message == (
            "fake: rank 1 sent a malformed control message: a follower sent a Report (of step 2)"
        )
        assert [r.formation for r in await run.spawned()] == [2, 2]  # the whole group re-forms
        assert len(run.reports) == 2  # lost once


async def test_rank_0_s_report_before_its_followers_ready_is_held_for_ready() -> None:
    """Rank 0 steps once it is Ready; its first Report may reach the leader before a
    follower's Ready. It is handed out once the formation is ready, not dropped (a leader
    waiting for a rank's first report would wait forever)."""
    async with driven(2, is_free_running=True) as run:
        start = asyncio.ensure_future(run.group.start())
        rank_0, follower = await run.spawned()
        for rank in (rank_0, follower):
            rank.hello()
        for rank in (rank_0, follower):
            assert isinstance(await asyncio.to_thread(rank.receive), Setup)
        rank_0.send(Ready(rank=0))
        rank_0.send(
            Report(
                step=0,
                rank=0,
                num_posts=0,
                status=StepStatus.OK,
                has_work=False,
                result=encode_raw(Value(3)),
            )
        )
        await asyncio.sleep(0.3)  # the report arrives while the group still forms
        assert run.reports == [] and run.readiness == []
        follower.send(Ready(rank=1))
        await start
        await wait_for(lambda: len(run.reports) == 1, WAIT_S)
        assert run.reports[0].result == Value(3) and run.readiness == [True]
