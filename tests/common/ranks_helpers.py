"""Shared helpers of the rank supervisor tests: hand-made ranks that join over the control
channel and say exactly what a test makes them say (no torch)."""

from __future__ import annotations

import asyncio
import os

import msgspec
import zmq

from services.common.ranks.config import RankGroupConfig, RankMode, StepSpec
from services.common.ranks.group import RankGroup
from services.common.ranks.messages import (
    Executed,
    Hello,
    Ping,
    Ready,
    Setup,
    StepReply,
    StepRequest,
    StepStatus,
    ToRank,
    decode_to_rank,
    encode,
    encode_raw,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Value(msgspec.Struct, frozen=True):
    value: int


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
