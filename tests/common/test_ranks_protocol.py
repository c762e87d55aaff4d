"""The rank group's leader side without torch: messages, the agreement and outcome rules, the
config's checks, and the supervisor driven by hand-made ranks that join over the control
channel (join mode) and say exactly what a test makes them say: garbage included.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec
import pytest
import zmq

from services.common.errors import CapacityError, UnavailableError
from services.common.ranks.agreement import (
    STATUS_BYTES,
    DesyncError,
    agree,
    pack_status,
    unpack_status,
)
from services.common.ranks.config import RankGroupConfig, RankMode, StepSpec
from services.common.ranks.errors import RankStartError, StepFailedError
from services.common.ranks.group import RankGroup
from services.common.ranks.messages import (
    MAX_ERROR_CHARS,
    Executed,
    Hello,
    Ping,
    RankStatus,
    Ready,
    Setup,
    Shutdown,
    StartFailed,
    StartStage,
    StepReply,
    StepRequest,
    StepStatus,
    ToLeader,
    ToRank,
    decode_to_leader,
    decode_to_rank,
    encode,
    encode_raw,
    error_text,
)
from services.common.ranks.outcome import step_outcome
from services.common.ranks.restarts import RestartPolicy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Value(msgspec.Struct, frozen=True):
    value: int


# --- messages ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "message",
    [
        Setup("a.b:C", encode_raw(Value(1)), 5, "127.0.0.1", 1234, 3.0, 10.0),
        StepRequest(step=3, timeout_s=2.0, payload=encode_raw(Value(7))),
        Ping(step=3),
        Shutdown(step=3),
    ],
)
def test_messages_to_a_rank_round_trip(message: ToRank) -> None:
    decoded = decode_to_rank(encode(message))
    assert type(decoded) is type(message)
    assert encode(decoded) == encode(message)


@pytest.mark.parametrize(
    "message",
    [
        Hello(rank=1, world_size=2, generation=3, pid=99, device="cuda:1", store_port=0, token="t"),
        StartFailed(rank=1, generation=3, stage=StartStage.DEVICE, error="RuntimeError: no GPU"),
        Ready(rank=1),
        Executed(step=4, rank=1),
        StepReply(step=4, rank=1, status=StepStatus.OK, result=encode_raw(Value(2))),
        StepReply(
            step=4,
            rank=1,
            status=StepStatus.FAILED,
            error="step 4 failed on rank 0: x",
            error_type="X",
        ),
    ],
)
def test_messages_to_the_leader_round_trip(message: ToLeader) -> None:
    decoded = decode_to_leader(encode(message))
    assert type(decoded) is type(message)
    assert encode(decoded) == encode(message)


def test_a_message_of_the_other_direction_or_garbage_does_not_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_to_leader(encode(Ping(step=1)))
    with pytest.raises(msgspec.DecodeError):
        decode_to_rank(b"\xff\x00garbage")


def test_error_texts_are_cut_to_fit_a_status_row() -> None:
    text = error_text(RuntimeError("é" * 10 * MAX_ERROR_CHARS))
    assert len(text) == MAX_ERROR_CHARS and text.endswith("...")
    row = pack_status(
        RankStatus(step=1, rank=0, is_ok=False, error=text, error_type="CapacityError")
    )
    assert len(row) == STATUS_BYTES
    assert unpack_status(row).error == text


# --- agreement -----------------------------------------------------------------------
def ok(rank: int, step: int = 4) -> RankStatus:
    return RankStatus(step=step, rank=rank, is_ok=True)


def bad(rank: int, error: str, error_type: str = "", step: int = 4) -> RankStatus:
    return RankStatus(step=step, rank=rank, is_ok=False, error=error, error_type=error_type)


def test_agreement_is_none_when_every_rank_succeeded() -> None:
    assert agree([ok(0), ok(1), ok(2)], 4) is None


def test_agreement_names_the_lowest_failing_rank_and_the_others() -> None:
    statuses = [ok(0), bad(1, "RuntimeError: boom", "CapacityError"), bad(2, "ValueError: other")]
    agreed = agree(statuses, 4)
    assert agreed is not None and agreed.error_type == "CapacityError"
    assert agreed.error == "step 4 failed on rank 1: RuntimeError: boom (ranks 2 failed too)"
    assert agree(list(statuses), 4) == agreed  # every rank computes the same from the same rows


@pytest.mark.parametrize("statuses", [[ok(0), ok(1, step=5)], [ok(1), ok(0)], [ok(0), ok(0)]])
def test_agreement_refuses_out_of_sync_rows(statuses: list[RankStatus]) -> None:
    with pytest.raises(DesyncError):
        agree(statuses, 4)


# --- the caller's outcome ------------------------------------------------------------
DECODER = msgspec.msgpack.Decoder(Value)


def reply_ok(rank: int, value: msgspec.Struct) -> StepReply:
    return StepReply(step=4, rank=rank, status=StepStatus.OK, result=encode_raw(value))


def reply_failed(rank: int, error: str, error_type: str = "") -> StepReply:
    return StepReply(
        step=4, rank=rank, status=StepStatus.FAILED, error=error, error_type=error_type
    )


def test_outcome_is_every_ranks_result_in_rank_order() -> None:
    assert step_outcome(4, [reply_ok(0, Value(1)), reply_ok(1, Value(2))], DECODER) == [
        Value(1),
        Value(2),
    ]


def test_outcome_of_a_failed_step_is_the_agreed_error_as_its_class() -> None:
    text = "step 4 failed on rank 1: CapacityError: no pages"
    error = step_outcome(
        4, [reply_failed(0, text, "CapacityError"), reply_failed(1, text, "CapacityError")], DECODER
    )
    assert isinstance(error, CapacityError) and error.message == text
    plain = step_outcome(4, [reply_failed(0, "step 4 failed on rank 0: RuntimeError: x")], DECODER)
    assert (
        type(plain) is StepFailedError
        and plain.message == "step 4 failed on rank 0: RuntimeError: x"
    )


def test_outcome_of_a_malformed_reply_or_result_names_the_rank() -> None:
    malformed = step_outcome(
        4, [reply_ok(0, Value(1)), "rank 1 sent a malformed control message"], DECODER
    )
    assert (
        isinstance(malformed, StepFailedError)
        and malformed.message == "rank 1 sent a malformed control message"
    )
    wrong = step_outcome(4, [reply_ok(0, Value(1)), reply_ok(1, Ping(step=1))], DECODER)
    assert isinstance(wrong, StepFailedError)
    assert wrong.message.startswith("rank 1 sent a malformed result for step 4: ")


# --- config and restart policy -------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "at least one device"),
        ({"devices": ("gpu0",)}, "'cpu' or 'cuda:N'"),
        ({"devices": ("cpu",), "world_size": 2}, "world_size is len"),
        ({"devices": ("cpu",), "control_addr": "tcp://0.0.0.0:5000"}, "never a wildcard"),
        ({"devices": ("cpu",), "control_addr": "tcp://10.0.0.1:5000"}, "must be loopback"),
        ({"devices": ("cpu",), "control_addr": "udp://x"}, "is not ipc://PATH"),
        ({"devices": ("cpu",), "step_timeout_s": 0}, "step_timeout_s must be > 0"),
        ({"devices": ("cpu",), "heartbeat_s": 5, "leader_timeout_s": 5}, "must exceed heartbeat_s"),
        ({"mode": RankMode.JOIN, "world_size": 2}, "needs control_addr"),
        (
            {"mode": RankMode.JOIN, "control_addr": "tcp://*:5000", "world_size": 2},
            "never a wildcard",
        ),
        (
            {"mode": RankMode.JOIN, "control_addr": "ipc:///tmp/x", "devices": ("cpu",)},
            "leave devices empty",
        ),
        ({"mode": RankMode.JOIN, "control_addr": "ipc:///tmp/x"}, "world_size >= 1"),
    ],
)
def test_config_refuses_what_cannot_run(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankGroupConfig(**kwargs)


def test_a_step_target_must_name_a_class() -> None:
    with pytest.raises(ValueError, match="package.module:ClassName"):
        StepSpec("tests.common.test_ranks_steps", Value, Value(0))


def test_restart_backoff_doubles_up_to_its_cap_and_attempts_are_bounded() -> None:
    policy = RestartPolicy(
        RankGroupConfig(
            devices=("cpu",),
            max_restart_attempts=4,
            restart_backoff_s=1.0,
            max_restart_backoff_s=3.0,
        )
    )
    assert [policy.next_backoff_s() for _ in range(5)] == [1.0, 2.0, 3.0, 3.0, None]
    policy.reset()
    assert policy.next_backoff_s() == 1.0


def test_the_leader_imports_no_torch() -> None:
    code = "import sys, services.common.ranks.group; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


# --- the supervisor, driven by hand-made joined ranks ---------------------------------
class FakeRank:
    """One rank of a join-mode group that speaks the control protocol by hand (no torch)."""

    def __init__(self, addr: str, rank: int, world_size: int, token: str = "") -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(addr)
        self.rank, self.world_size, self.token = rank, world_size, token

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send(encode(message))

    def send_raw(self, data: bytes) -> None:
        self.socket.send(data)

    def receive(self, timeout_s: float = 10.0, *, skip_pings: bool = True) -> ToRank:
        while self.socket.poll(int(timeout_s * 1000)):
            message = decode_to_rank(self.socket.recv())
            if not (skip_pings and isinstance(message, Ping)):
                return message
        raise TimeoutError(f"fake rank {self.rank}: nothing from the leader within {timeout_s} s")

    def hello(self) -> None:
        self.send(
            Hello(
                rank=self.rank,
                world_size=self.world_size,
                generation=-1,
                pid=os.getpid(),
                device="cpu",
                store_port=0,
                token=self.token,
            )
        )

    def join(self) -> Setup:
        self.hello()
        setup = self.receive()
        assert isinstance(setup, Setup)
        self.send(Ready(rank=self.rank))
        return setup

    def next_step(self) -> StepRequest:
        request = self.receive()
        assert isinstance(request, StepRequest)
        return request

    def answer(self, request: StepRequest, value: msgspec.Struct) -> None:
        self.send(Executed(step=request.step, rank=self.rank))
        self.send(
            StepReply(
                step=request.step, rank=self.rank, status=StepStatus.OK, result=encode_raw(value)
            )
        )

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()


def join_config(tmp_path, world_size: int, **overrides) -> RankGroupConfig:
    settings = dict(
        mode=RankMode.JOIN,
        world_size=world_size,
        control_addr=f"ipc://{tmp_path}/control",
        step_timeout_s=2.0,
        start_timeout_s=5.0,
        heartbeat_s=0.2,
        leader_timeout_s=5.0,
        restart_backoff_s=0.05,
        max_restart_attempts=2,
        stop_grace_s=0.5,
    )
    settings.update(overrides)
    return RankGroupConfig(**settings)


class Joined:
    """A join-mode RankGroup with its fake ranks, and every readiness change it reported."""

    def __init__(self, config: RankGroupConfig) -> None:
        self.config = config
        self.readiness: list[bool] = []
        self.group = RankGroup(
            config,
            StepSpec("tests.common.test_ranks_steps:EchoStep", Value, Value(0)),
            on_ready_change=self.readiness.append,
        )
        self.ranks: list[FakeRank] = []

    async def form(self, token: str = "") -> list[Setup]:
        """Start the group (first time) or wait for its re-form, with fresh fake ranks."""
        self.ranks = [
            FakeRank(self.config.control_addr, r, self.config.world_size, token)
            for r in range(self.config.world_size)
        ]
        if self.group.state.value == "forming" and not self.readiness:
            start = asyncio.ensure_future(self.group.start())
            setups = await asyncio.gather(*(asyncio.to_thread(r.join) for r in self.ranks))
            await start
        else:
            setups = await asyncio.gather(*(asyncio.to_thread(r.join) for r in self.ranks))
            await wait_for(lambda: self.group.is_ready)
        return list(setups)

    async def close(self) -> None:
        await self.group.aclose()
        for rank in self.ranks:
            rank.close()


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def joined(tmp_path, request):
    world_size, overrides = getattr(request, "param", (2, {}))
    group = Joined(join_config(tmp_path, world_size, **overrides))
    try:
        yield group
    finally:
        await group.close()


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
