"""Shared helpers of the tests whose rank processes are fake ranks (``fake_rank.py``) that the
test drives by hand: the test's puppet socket, one handle per fake rank, a group of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import zmq

from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.free_supervisor import Reported
from services.common.ranks.group import RankGroup
from services.common.ranks.messages import (
    Hello,
    Ping,
    Ready,
    Setup,
    StepExecuted,
    StepReply,
    StepRequest,
    StepStatus,
    ToRank,
    decode_to_rank,
    encode,
    encode_raw,
)
from tests.common.fake_rank import PUPPETS_ENV, Announce
from tests.common.ranks_group_helpers import is_gone
from tests.conftest import environ, rank_children

FAKE_RANK = "tests.common.fake_rank"
TOKEN = "hand-driven-token"
NO_STEP = "tests.common.fake_rank:NoStep"  # sent in Setup; a fake rank imports no step class
WAIT_S = 30.0  # a fake rank's python start-up on a loaded 2-core machine


class Value(msgspec.Struct, frozen=True):
    value: int


class Puppets:
    """The test's ROUTER every fake rank connects to; used by one thread at a time."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self._socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._inbox: dict[bytes, deque[bytes]] = {}  # relay -> frames from the leader
        self._announced: deque[tuple[bytes, Announce]] = deque()
        self.pids: list[int] = []  # of every fake rank that announced itself

    def next_rank(self, timeout_s: float = WAIT_S) -> FakeRank:
        """The next fake rank that announced itself (its process started)."""
        self._wait(lambda: bool(self._announced), timeout_s, "no fake rank started")
        relay, announce = self._announced.popleft()
        return FakeRank(self, relay, announce)

    def has_announced(self) -> bool:
        """Whether a fake rank not yet taken by ``next_rank`` announced itself (does not wait)."""
        while self._socket.poll(0):
            self._file(*self._socket.recv_multipart())
        return bool(self._announced)

    def frame(self, relay: bytes, timeout_s: float) -> bytes:
        inbox = self._inbox[relay]
        self._wait(lambda: bool(inbox), timeout_s, "nothing from the leader")
        return inbox.popleft()

    def send(self, relay: bytes, verb: bytes, frame: bytes) -> None:
        self._socket.send_multipart([relay, verb, frame])

    def _wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline_mono = time.monotonic() + timeout_s
        while not predicate():
            remaining_ms = int((deadline_mono - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._socket.poll(remaining_ms):
                raise TimeoutError(f"{what} within {timeout_s} s")
            self._file(*self._socket.recv_multipart())

    def _file(self, relay: bytes, frame: bytes) -> None:
        if relay in self._inbox:
            self._inbox[relay].append(frame)
            return
        announce = msgspec.msgpack.decode(frame, type=Announce)
        self._inbox[relay] = deque()
        self._announced.append((relay, announce))
        self.pids.append(announce.pid)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class FakeRank:
    """The test's end of one spawned fake rank (``fake_rank.py``): what is sent here, that
    rank says to its leader; what its leader sends it comes back here."""

    def __init__(self, puppets: Puppets, relay: bytes, announce: Announce) -> None:
        self._puppets, self._relay = puppets, relay
        self.rank, self.formation, self.pid = announce.rank, announce.formation, announce.pid
        self.world_size = announce.world_size

    def send(self, message: msgspec.Struct) -> None:
        self.send_raw(encode(message))

    def send_raw(self, data: bytes) -> None:
        self._puppets.send(self._relay, b"send", data)

    def exit(self, code: int) -> None:
        self._puppets.send(self._relay, b"exit", str(code).encode())

    def receive(self, timeout_s: float = WAIT_S, *, skip_pings: bool = True) -> ToRank:
        while True:
            message = decode_to_rank(self._puppets.frame(self._relay, timeout_s))
            if not (skip_pings and isinstance(message, Ping)):
                return message

    def hello(self, token: str = TOKEN) -> None:
        self.send(
            Hello(
                rank=self.rank,
                world_size=self.world_size,
                formation=self.formation,
                pid=self.pid,
                device="cpu",
                store_port=0,
                token=token,
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
        self.send(StepExecuted(step=request.step, rank=self.rank))
        self.send(
            StepReply(
                step=request.step, rank=self.rank, status=StepStatus.OK, result=encode_raw(value)
            )
        )


class Stranger:
    """A peer of the leader's control socket that no formation spawned: a DEALER of this
    process."""

    def __init__(self, addr: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(addr)

    def send(self, message: msgspec.Struct) -> None:
        self._socket.send(encode(message))

    def send_raw(self, data: bytes) -> None:
        self._socket.send(data)

    def receive(self, timeout_s: float = WAIT_S) -> ToRank:
        if not self._socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the stranger heard nothing from the leader within {timeout_s} s")
        return decode_to_rank(self._socket.recv())

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def fake_config(num_ranks: int, **overrides) -> RankGroupConfig:
    settings = dict(
        name="fake",
        devices=("cpu",) * num_ranks,
        rank_module=FAKE_RANK,
        step_timeout_s=WAIT_S,
        start_timeout_s=WAIT_S,
        heartbeat_s=1.0,
        liveness_timeout_s=WAIT_S,  # a fake rank answers no ping
        leader_timeout_s=WAIT_S,
        restart_backoff_s=0.05,
        max_restart_attempts=2,
        stop_grace_s=0.2,  # a fake rank leaves only when told to (``exit``): killed after this
        internal_token=TOKEN,
    )
    settings.update(overrides)
    return RankGroupConfig(**settings)


class Driven:
    """A RankGroup of fake ranks, the ranks of its current formation, and every readiness
    change (and, free-running, every report) it reported."""

    def __init__(self, config: RankGroupConfig, puppets: Puppets) -> None:
        self.config, self.puppets = config, puppets
        self.readiness: list[bool] = []
        self.reports: list[Reported] = []
        self.group = RankGroup(
            config,
            StepSpec(NO_STEP, Value, Value(0)),
            on_ready_change=self.readiness.append,
            on_report=self.reports.append if config.is_free_running else None,
        )
        self.ranks: list[FakeRank] = []

    async def spawned(self) -> list[FakeRank]:
        """The fake ranks of the formation starting now, in rank order."""
        ranks = [await asyncio.to_thread(self.puppets.next_rank) for _ in self.config.devices]
        self.ranks = sorted(ranks, key=lambda r: r.rank)
        assert [r.rank for r in self.ranks] == list(range(self.config.num_ranks))
        assert len({r.formation for r in self.ranks}) == 1
        return self.ranks

    async def form(self) -> None:
        """Start the group and join its first formation's fake ranks."""
        start = asyncio.ensure_future(self.group.start())
        try:
            for rank in await self.spawned():  # rank 0 first: its Hello names the store
                await asyncio.to_thread(rank.join)
        except BaseException:
            start.cancel()  # the start stops the group
            raise
        await start


@contextlib.asynccontextmanager
async def driven(num_ranks: int = 1, **overrides):
    """A ``Driven`` group, not started; at exit it is stopped and every fake rank it spawned
    is gone and reaped."""
    puppets = Puppets()
    try:
        with environ({PUPPETS_ENV: puppets.addr}):
            run = Driven(fake_config(num_ranks, **overrides), puppets)
            try:
                yield run
            finally:
                await run.group.aclose()
        assert all(is_gone(pid) for pid in puppets.pids), puppets.pids
        assert rank_children() == []
    finally:
        puppets.close()
