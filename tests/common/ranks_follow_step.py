"""A free-running step class for groups of several ranks (``FollowStep``): rank 0 steps by
itself, its followers run what it tells them.

Each rank of a group of several binds a pyzmq PULL socket on loopback at construction, and the
ranks all-reduce its port over the CPU group, so rank 0 learns every follower's. For each step,
rank 0 sends each follower a ``Work`` (PUSH), then all-reduces (device group) ``[rank + 1, pieces
of work run]`` with them: the result's ``rank_sum`` and ``num_followed`` prove every rank took
part in each step. A follower's ``follow`` waits for its next ``Work`` at most ``timeout_s`` and
joins that all-reduce. A collective that fails on rank 0 (a follower is gone) breaks the group:
``on_failed`` raises and rank 0 leaves, as a real step class's should.
"""

from __future__ import annotations

import os
import time

import msgspec
import torch
import torch.distributed as dist
import zmq

from services.common.errors import CapacityError
from services.common.ranks.step import FreeRankStep, RankContext

TARGET = "tests.common.ranks_follow_step:FollowStep"


class FollowInit(msgspec.Struct, frozen=True):
    step_sleep_s: float = 0.0  # rank 0 takes this long per step (a busy group's pace)


class FollowPayload(msgspec.Struct, frozen=True):
    value: int
    ticks: int = 0  # steps of work to add
    hold_s: float = 0.0  # rank 0 sleeps this long in the step, its followers waiting in it
    failing_rank: int = -1  # that rank's ``follow`` (or rank 0's step, for 0) raises


class FollowResult(msgspec.Struct, frozen=True):
    step: int
    values: tuple[int, ...]  # of the posts this step applied
    ticks_left: int
    pid: int
    rank_sum: int  # all-reduced in this step: sum of rank + 1 over every rank that took part
    num_followed: int  # all-reduced: the pieces of work the followers ran, this one included
    num_warmed_up: int  # all-reduced at warm-up: the ranks whose warmup ran
    has_process_group: bool


class Work(msgspec.Struct, frozen=True):
    """Rank 0 -> each follower: join step ``step``'s all-reduce."""

    step: int
    failing_rank: int = -1


class FollowStep(FreeRankStep):
    init_type = FollowInit
    payload_type = FollowPayload
    result_type = FollowResult

    def __init__(self, ctx: RankContext, init: FollowInit) -> None:
        self.ctx, self.step_sleep_s = ctx, init.step_sleep_s
        self.ticks, self.num_followed, self.num_warmed_up = 0, 0, 0
        self.is_broken = False  # a collective failed: this rank cannot go on in the group
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pushes: list[zmq.Socket] = []
        if ctx.cpu_group is None:  # a group of one
            return
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        ports = torch.zeros(ctx.world_size, dtype=torch.int64)
        ports[ctx.rank] = port
        dist.all_reduce(ports, group=ctx.cpu_group)
        if ctx.rank == 0:
            for follower_port in ports[1:].tolist():
                push = self._context.socket(zmq.PUSH)
                push.connect(f"tcp://127.0.0.1:{follower_port}")
                self._pushes.append(push)

    def warmup(self) -> None:
        self.num_warmed_up = self._all_reduce(self.ctx.cpu_group, 1)[0]

    def run_step(self, step: int, payloads: list[FollowPayload]) -> FollowResult:
        hold_s, failing_rank = 0.0, -1
        for payload in payloads:
            if payload.failing_rank == 0:
                raise CapacityError(f"post {payload.value} asked rank 0 to fail")
            self.ticks += payload.ticks
            hold_s = max(hold_s, payload.hold_s)
            failing_rank = max(failing_rank, payload.failing_rank)
        if self.ticks:
            self.ticks -= 1
        work = msgspec.msgpack.encode(Work(step, failing_rank))
        for push in self._pushes:
            push.send(work, zmq.NOBLOCK)
        time.sleep(self.step_sleep_s + hold_s)
        rank_sum, num_followed = self._all_reduce(self.ctx.device_group, 1, 0)
        values = tuple(p.value for p in payloads)
        return FollowResult(
            step,
            values,
            self.ticks,
            os.getpid(),
            rank_sum,
            num_followed,
            self.num_warmed_up,
            self.ctx.cpu_group is not None,
        )

    def follow(self, timeout_s: float) -> None:
        if not self._pull.poll(int(timeout_s * 1000)):
            return
        work = msgspec.msgpack.decode(self._pull.recv(), type=Work)
        if work.failing_rank == self.ctx.rank:
            raise RuntimeError(f"rank {self.ctx.rank} was asked to fail at step {work.step}")
        self.num_followed += 1
        self._all_reduce(self.ctx.device_group, self.ctx.rank + 1, self.num_followed)

    def _all_reduce(self, group: dist.ProcessGroup | None, *values: int) -> list[int]:
        """``values`` summed over ``group`` (None: a group of one); a failure breaks the rank."""
        if group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, group=group)
        except Exception:
            self.is_broken = True
            raise
        return tensor.tolist()

    def has_work(self) -> bool:
        return self.ticks > 0

    def on_failed(self, step: int, error: str) -> None:
        if self.is_broken:
            raise RuntimeError(f"step {step} broke the group's collective: {error}")

    def close(self) -> None:
        for push in self._pushes:
            push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
