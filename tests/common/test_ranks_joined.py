"""The rank group's supervisor driven by hand-made ranks that join over the control channel
(join mode) and say exactly what a test makes them say: garbage included."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.common.errors import CapacityError, UnavailableError
from services.common.ranks.errors import RankStartError, StepFailedError
from services.common.ranks.messages import (
    Executed,
    Ping,
    Shutdown,
    StartFailed,
    StartStage,
    StepReply,
    StepStatus,
)
from tests.common.ranks_helpers import FakeRank, Joined, Value, join_config, wait_for


async def test_joined_ranks_get_their_setup_and_every_step_in_order(joined: Joined) -> None:
    setups = await joined.form()
    assert setups[0] == setups[1]
    assert (setups[0].step_target, setups[0].first_step, setups[0].store_host) == (
        "tests.common.test_ranks_steps:EchoStep",
        1,
        "",
    )
    assert joined.readiness == [True]
    futures = [joined.group.submit(Value(v)) for v in (10, 20)]
    for expected_step, value in ((1, 10), (2, 20)):  # the second waits until the first is answered
        requests = await asyncio.gather(*(asyncio.to_thread(r.next_step) for r in joined.ranks))
        assert [q.step for q in requests] == [expected_step, expected_step]
        assert msgspec.msgpack.decode(requests[0].payload, type=Value) == Value(value)
        for rank, request in zip(joined.ranks, requests, strict=True):
            rank.answer(request, Value(value + rank.rank))
    assert [await asyncio.wrap_future(f) for f in futures] == [
        [Value(10), Value(11)],
        [Value(20), Value(21)],
    ]


@pytest.mark.parametrize("joined", [(1, {})], indirect=True)
async def test_garbage_from_a_rank_fails_that_step_and_the_leader_serves_on(joined: Joined) -> None:
    await joined.form()
    (rank,) = joined.ranks
    future = joined.group.submit(Value(1))
    request = await asyncio.to_thread(rank.next_step)
    rank.send_raw(b"\xff\x00 not msgpack")
    with pytest.raises(
        StepFailedError, match=r"^rank 0 sent a malformed control message during step 1: "
    ):
        await asyncio.wrap_future(future)
    rank.answer(request, Value(1))  # late: dropped, not taken for step 2
    future = joined.group.submit(Value(2))
    rank.answer(await asyncio.to_thread(rank.next_step), Value(2))
    assert await asyncio.wrap_future(future) == [Value(2)]
    assert joined.group.is_ready and joined.readiness == [True]


@pytest.mark.parametrize("joined", [(1, {})], indirect=True)
async def test_messages_from_a_stranger_are_dropped(joined: Joined) -> None:
    await joined.form()
    stranger = FakeRank(joined.config.control_addr, 0, 1)
    try:
        stranger.send_raw(b"garbage")
        stranger.send(StepReply(step=1, rank=0, status=StepStatus.BROKEN, error="forged"))
        stranger.hello()  # rank 0 has joined already: refused
        assert isinstance(await asyncio.to_thread(stranger.receive), Shutdown)
    finally:
        stranger.close()
    future = joined.group.submit(Value(3))
    joined.ranks[0].answer(await asyncio.to_thread(joined.ranks[0].next_step), Value(3))
    assert await asyncio.wrap_future(future) == [Value(3)]


async def test_an_agreed_failure_reaches_the_caller_as_its_class(joined: Joined) -> None:
    await joined.form()
    future = joined.group.submit(Value(1))
    text = "step 1 failed on rank 1: CapacityError: no pages"
    for rank in joined.ranks:
        request = await asyncio.to_thread(rank.next_step)
        rank.send(
            StepReply(
                step=request.step,
                rank=rank.rank,
                status=StepStatus.FAILED,
                error=text,
                error_type="CapacityError",
            )
        )
    with pytest.raises(CapacityError) as caught:
        await asyncio.wrap_future(future)
    assert caught.value.message == text and joined.group.is_ready


async def test_a_broken_rank_fail_stops_the_group_which_reforms_and_serves(joined: Joined) -> None:
    await joined.form()
    future = joined.group.submit(Value(1))
    requests = [await asyncio.to_thread(r.next_step) for r in joined.ranks]
    joined.ranks[0].answer(requests[0], Value(1))
    joined.ranks[1].send(
        StepReply(
            step=1,
            rank=1,
            status=StepStatus.BROKEN,
            error="rank 1: status exchange of step 1 failed: timed out",
        )
    )
    with pytest.raises(
        UnavailableError, match="rank 1: status exchange of step 1 failed: timed out"
    ):
        await asyncio.wrap_future(future)
    assert joined.readiness == [True, False] and not joined.group.is_ready
    for rank in joined.ranks:  # the old generation is told to leave
        assert isinstance(await asyncio.to_thread(rank.receive), Shutdown)
        rank.close()
    with pytest.raises(UnavailableError, match="re-forming"):
        await joined.group.step(Value(2))
    await joined.form()  # a new generation joins
    assert joined.readiness == [True, False, True]
    future = joined.group.submit(Value(3))
    for rank in joined.ranks:
        request = await asyncio.to_thread(rank.next_step)
        assert request.step == 2  # step numbers go on across generations
        rank.answer(request, Value(3))
    assert await asyncio.wrap_future(future) == [Value(3), Value(3)]


@pytest.mark.parametrize("joined", [(2, {"step_timeout_s": 0.5})], indirect=True)
async def test_a_missed_deadline_fail_stops_naming_the_late_rank(joined: Joined) -> None:
    await joined.form()
    start = asyncio.get_running_loop().time()
    future = joined.group.submit(Value(1))
    request = await asyncio.to_thread(joined.ranks[0].next_step)
    joined.ranks[0].send(
        Executed(step=request.step, rank=0)
    )  # rank 0 waits in the exchange; rank 1 is silent
    with pytest.raises(
        UnavailableError, match=r"rank 1 did not finish step 1 within its 0.5 s deadline"
    ):
        await asyncio.wrap_future(future)
    assert asyncio.get_running_loop().time() - start < 0.5 + 1.0
    assert joined.readiness == [True, False]


@pytest.mark.parametrize(
    "joined", [(1, {"max_restart_attempts": 1, "start_timeout_s": 0.3})], indirect=True
)
async def test_re_forms_are_bounded(joined: Joined) -> None:
    await joined.form()
    future = joined.group.submit(Value(1))
    request = await asyncio.to_thread(joined.ranks[0].next_step)
    joined.ranks[0].send(
        StepReply(step=request.step, rank=0, status=StepStatus.BROKEN, error="rank 0: gone")
    )
    with pytest.raises(UnavailableError):
        await asyncio.wrap_future(future)
    await wait_for(
        lambda: joined.group.state.value == "failed"
    )  # nobody re-joined within start_timeout_s
    with pytest.raises(
        UnavailableError, match="failed for good after: the group did not form within 0.3 s"
    ):
        await joined.group.step(Value(2))


@pytest.mark.parametrize("joined", [(1, {"heartbeat_s": 0.1})], indirect=True)
async def test_idle_ranks_are_pinged_and_a_vanished_one_is_noticed(joined: Joined) -> None:
    await joined.form()
    ping = await asyncio.to_thread(joined.ranks[0].receive, 5.0, skip_pings=False)
    assert ping == Ping(step=0)
    joined.ranks[0].close()
    joined.ranks = []
    await wait_for(lambda: not joined.group.is_ready)
    assert joined.readiness == [True, False]


async def test_a_rank_that_fails_to_start_fails_the_start_naming_it(joined: Joined) -> None:
    ranks = [FakeRank(joined.config.control_addr, r, 2) for r in range(2)]
    joined.ranks = ranks
    start = asyncio.ensure_future(joined.group.start())
    ranks[0].hello()
    ranks[1].hello()
    ranks[1].send(
        StartFailed(
            rank=1, generation=-1, stage=StartStage.CONSTRUCT, error="MemoryError: no memory"
        )
    )
    with pytest.raises(
        RankStartError, match=r"rank 1 \(cpu\) failed to start at construct: MemoryError: no memory"
    ):
        await start
    assert joined.readiness == [] and joined.group.state.value == "stopped"


async def test_a_hello_with_the_wrong_token_is_refused(tmp_path) -> None:
    joined = Joined(join_config(tmp_path, 1, internal_token="secret", start_timeout_s=0.5))
    try:
        start = asyncio.ensure_future(joined.group.start())
        impostor = FakeRank(joined.config.control_addr, 0, 1, token="guess")
        joined.ranks = [impostor]
        impostor.hello()
        assert isinstance(await asyncio.to_thread(impostor.receive), Shutdown)
        with pytest.raises(RankStartError, match=r"no Hello from ranks \[0\]"):
            await start
    finally:
        await joined.close()


async def test_stop_fails_the_step_in_flight_and_tells_ranks_to_leave(joined: Joined) -> None:
    await joined.form()
    future = joined.group.submit(Value(1))
    await asyncio.to_thread(joined.ranks[0].next_step)
    await joined.group.aclose()
    with pytest.raises(UnavailableError, match="stopped"):
        await asyncio.wrap_future(future)
    assert isinstance(await asyncio.to_thread(joined.ranks[0].receive), Shutdown)
    with pytest.raises(UnavailableError, match="stopped"):
        await joined.group.step(Value(2))
    assert joined.readiness == [True, False]
