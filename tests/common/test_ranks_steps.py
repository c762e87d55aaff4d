"""The step classes the rank processes of the rank tests import by path, and the rank's step
loop driven in this process (one gloo rank): OK, a raising step, a malformed payload, a
wrong result type, a malformed control message, a StageServeError's class, Pings answered.

``EchoStep`` (``tests.common.test_ranks_steps:EchoStep``) runs an all-reduce on each of its
groups (on its device for the device group: NCCL on CUDA ranks), then does what the payload
asks of its rank: raise, SIGKILL or SIGSTOP itself, sleep, or return the wrong type. Every
result reports the last agreed error the rank saw.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import msgspec
import pytest
import torch
import torch.distributed as dist

from services.common.errors import CapacityError
from services.common.ranks.channel import Malformed
from services.common.ranks.messages import (
    NIL,
    Ping,
    Pong,
    Setup,
    Shutdown,
    StepExecuted,
    StepReply,
    StepRequest,
    StepStatus,
    encode_raw,
)
from services.common.ranks.rank_loop import LoopExit, RankLoop
from services.common.ranks.step import BaseRankStep, RankContext

TARGET = "tests.common.test_ranks_steps:EchoStep"


class EchoInit(msgspec.Struct, frozen=True):
    fail_on_rank: int = -1  # the constructor raises MemoryError on this rank
    warmup_sleep_s: float = 0.0


class EchoPayload(msgspec.Struct, frozen=True):
    value: int
    raise_on_rank: int = -1
    capacity_error_on_rank: int = -1
    kill_on_rank: int = -1
    stop_on_rank: int = -1
    wrong_result_on_rank: int = -1
    leave_on_rank: int = -1  # after its all-reduces: close its groups, then exit 7 shortly after
    sleep_s: float = 0.0


class EchoResult(msgspec.Struct, frozen=True):
    step: int
    rank: int
    world_size: int
    value: int
    device_total: int  # all-reduce of value over the device group
    cpu_total: int  # all-reduce of value over the cpu group
    num_executed: int  # steps this rank process executed
    last_error: str  # the agreed error this rank last saw in on_failed
    pid: int


class Garbage(msgspec.Struct, frozen=True):
    junk: str


class EchoStep(BaseRankStep):
    init_type = EchoInit
    payload_type = EchoPayload
    result_type = EchoResult

    def __init__(self, ctx: RankContext, init: EchoInit) -> None:
        torch.set_num_threads(1)
        if init.fail_on_rank == ctx.rank:
            raise MemoryError("injected out of memory while loading")
        if ctx.device != "cpu":  # rank_main made it the current device
            assert torch.cuda.current_device() == torch.device(ctx.device).index
        self.ctx = ctx
        self.init = init
        self.num_executed = 0
        self.last_error = ""

    def warmup(self) -> None:
        time.sleep(self.init.warmup_sleep_s)

    def execute(self, step: int, payload: EchoPayload) -> msgspec.Struct:
        rank = self.ctx.rank
        self.num_executed += 1
        if payload.kill_on_rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if payload.stop_on_rank == rank:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(payload.sleep_s)
        totals = []
        for group, device in (
            (self.ctx.device_group, self.ctx.device),
            (self.ctx.cpu_group, "cpu"),
        ):
            value = torch.tensor([payload.value], device=device)
            dist.all_reduce(value, group=group)
            totals.append(int(value.item()))
        if payload.leave_on_rank == rank:  # its peers see a lost connection before the exit
            dist.destroy_process_group()
            time.sleep(0.1)
            os._exit(7)
        if payload.raise_on_rank == rank:
            raise RuntimeError(f"injected failure at value {payload.value}")
        if payload.capacity_error_on_rank == rank:
            raise CapacityError("injected: no pages left")
        if payload.wrong_result_on_rank == rank:
            return Garbage(junk="not an EchoResult")
        return EchoResult(
            step,
            rank,
            self.ctx.world_size,
            payload.value,
            totals[0],
            totals[1],
            self.num_executed,
            self.last_error,
            os.getpid(),
        )

    def on_failed(self, step: int, error: str) -> None:
        self.last_error = error


# --- the rank's step loop in this process (world size 1) --------------------------------
class FakeChannel:
    def __init__(self) -> None:
        self.sent: list[msgspec.Struct] = []
        self.inbox: list[msgspec.Struct] = []  # what ``receive`` hands the loop, in order

    def send(self, message: msgspec.Struct) -> None:
        self.sent.append(message)

    def receive(self, timeout_s: float) -> msgspec.Struct:
        assert self.inbox, "the loop asked for more messages than the test gave it"
        return self.inbox.pop(0)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=5)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def make_loop(group) -> tuple[RankLoop, FakeChannel]:
    ctx = RankContext(0, 1, "cpu", group, group, 5.0)
    setup = Setup(
        step_target=TARGET,
        init=encode_raw(EchoInit()),
        first_step=7,
        store_host="",
        store_port=0,
        collective_timeout_s=5.0,
        leader_timeout_s=10.0,
    )
    channel = FakeChannel()
    step = EchoStep(ctx, EchoInit())
    loop = RankLoop(channel, step, group, 0, setup, 0)  # type: ignore[arg-type]
    return loop, channel


def request(step: int, payload: msgspec.Struct) -> StepRequest:
    return StepRequest(step=step, timeout_s=5.0, payload=encode_raw(payload))


def test_a_step_returns_the_result_and_reports_executed(world_of_one) -> None:
    loop, channel = make_loop(world_of_one)
    reply = loop.run_step(request(7, EchoPayload(value=3)))
    assert reply.status is StepStatus.OK and reply.step == 7 and reply.rank == 0
    result = msgspec.msgpack.decode(reply.result, type=EchoResult)
    assert (result.step, result.value, result.device_total, result.cpu_total) == (7, 3, 3, 3)
    assert channel.sent == [StepExecuted(step=7, rank=0)]


def test_a_raising_step_fails_with_the_agreed_text_and_the_next_succeeds(world_of_one) -> None:
    loop, _ = make_loop(world_of_one)
    failed = loop.run_step(request(7, EchoPayload(value=1, raise_on_rank=0)))
    assert failed.status is StepStatus.FAILED and failed.result == NIL
    assert failed.error == "step 7 failed on rank 0: RuntimeError: injected failure at value 1"
    assert failed.error_type == ""
    ok = loop.run_step(request(8, EchoPayload(value=2)))
    assert ok.status is StepStatus.OK
    assert (
        msgspec.msgpack.decode(ok.result, type=EchoResult).last_error == failed.error
    )  # on_failed ran


def test_a_stageserve_error_keeps_its_class_name(world_of_one) -> None:
    loop, _ = make_loop(world_of_one)
    reply = loop.run_step(request(7, EchoPayload(value=1, capacity_error_on_rank=0)))
    assert reply.status is StepStatus.FAILED and reply.error_type == "CapacityError"
    assert reply.error == "step 7 failed on rank 0: CapacityError: injected: no pages left"


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            Garbage(junk="x"),
            "step 7 failed on rank 0: malformed step payload: Object missing required field "
            "`value`",
        ),
        (
            EchoPayload(value=1, wrong_result_on_rank=0),
            "step 7 failed on rank 0: execute returned Garbage, expected EchoResult",
        ),
    ],
)
def test_a_payload_or_result_of_the_wrong_shape_fails_the_step(
    world_of_one, payload, expected
) -> None:
    loop, _ = make_loop(world_of_one)
    reply = loop.run_step(request(7, payload))
    assert (reply.status, reply.error) == (StepStatus.FAILED, expected)
    assert loop.run_step(request(8, EchoPayload(value=1))).status is StepStatus.OK


def test_a_malformed_control_message_counts_as_the_due_step(world_of_one) -> None:
    loop, channel = make_loop(world_of_one)
    reply = loop.run_step(Malformed("MessagePack data is malformed"))
    assert isinstance(reply, StepReply) and reply.step == 7 and reply.status is StepStatus.FAILED
    assert reply.error == (
        "step 7 failed on rank 0: malformed control message from the leader: MessagePack data is "
        "malformed"
    )
    assert channel.sent == [StepExecuted(step=7, rank=0)]
    assert loop.run_step(request(8, EchoPayload(value=1))).status is StepStatus.OK


def test_an_idle_rank_answers_each_ping_with_a_pong_apart_from_its_steps(world_of_one) -> None:
    loop, channel = make_loop(world_of_one)
    channel.inbox += [Ping(step=6), request(7, EchoPayload(value=2)), Ping(step=7), Shutdown(7)]
    assert loop.serve() is LoopExit.SHUTDOWN
    pong_6, executed, reply, pong_7 = channel.sent
    assert (pong_6, executed, pong_7) == (Pong(step=6, rank=0), StepExecuted(7, 0), Pong(7, 0))
    assert isinstance(reply, StepReply) and (reply.step, reply.status) == (7, StepStatus.OK)
    assert msgspec.msgpack.decode(reply.result, type=EchoResult).value == 2


def test_a_group_of_one_agrees_on_its_own_status_without_an_exchange(
    world_of_one, monkeypatch
) -> None:
    def no_exchange(*args, **kwargs):
        raise AssertionError("a group of one exchanged its status")

    monkeypatch.setattr("services.common.ranks.rank_loop.exchange", no_exchange)
    loop, _ = make_loop(world_of_one)
    ok = loop.run_step(request(7, EchoPayload(value=2)))
    assert ok.status is StepStatus.OK
    failed = loop.run_step(request(8, EchoPayload(value=1, raise_on_rank=0)))
    assert (failed.status, failed.error) == (
        StepStatus.FAILED,
        "step 8 failed on rank 0: RuntimeError: injected failure at value 1",
    )
