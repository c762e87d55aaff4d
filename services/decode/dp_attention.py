"""Decode's DP attention (``--dp-attention``): the D DP ranks are one free-running rank group of
D processes. Each keeps its own requests, scheduler, KV pool and attention (whole heads); the
MLP and MoE layers split over the group (``TensorParallel.dp_attention``), so every rank joins
every forward of every other rank, with rows of its own or none.

One group step (``DpAttentionRankStep``):
  1. rank 0's loop runs ``run_step`` with the leader's posts, each naming its DP rank; it
     sends every follower its commands (an ``Order``, empty ones too: every rank takes part in
     every step) and runs its own;
  2. each rank's ``DecodeRank.execute`` applies its commands, plans its own batch, then agrees
     with the others on the step's rows per rank (``DpAgreement``: the max of every rank's row
     count, reduced over the CPU group, so the same number on every rank); rows 0 means no
     rank launches a forward; a rank without rows of its own runs an idle step (on CUDA the
     agreed size's graph replayed all padding, else its MLPs join eagerly with zero rows);
  3. every rank's report, whether it has work and when its timer is due are gathered to rank
     0, which answers the leader with one ``DpReports``.
What starts a coupled step is decided by rank 0 alone, from state every rank sent it (the
last gathered has-work flags and timers) and the leader's posts; what a step's forward looks
like comes from the agreed rows. No rank-local queue or cache decides whether a collective
runs, so no rank can start a forward the others skip. A rank that raises leaves (rank 0:
``on_failed`` raises); its peers are then stuck in a collective, and the leader's supervisor
fails the whole group (every DP rank's requests end UNAVAILABLE) and re-forms it.
"""

from __future__ import annotations

import logging
import math
import time

import msgspec
import torch
import torch.distributed as dist

from services.common.ranks.step import FreeRankStep, RankContext
from services.decode.messages import Command, DpReports, RankCommands, RankInit, RankReport
from services.decode.rank import DecodeRank, build_rank
from services.decode.tp_mirror import Pull, Pushes, exchange_addresses
from services.decode.tp_rank import load_shard
from services.engine.parallel import TensorParallel

logger = logging.getLogger(__name__)


class Order(msgspec.Struct, frozen=True):
    """Rank 0 to a follower: run group step ``step`` with these commands."""

    step: int
    commands: tuple[Command, ...]


class DpAgreement:
    """The step's rows per rank: the most any rank plans, the same number on every rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def rows(self, mine: int) -> int:
        count = torch.tensor([mine], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._group)
        return int(count.item())


class DpAttentionRankStep(FreeRankStep):
    """Every process of a DP-attention group: DP rank ``ctx.rank``'s ``DecodeRank`` over its
    share of the MLP and expert weights; rank 0 leads the group's steps (module docstring)."""

    init_type = RankInit
    payload_type = RankCommands
    result_type = DpReports

    def __init__(self, ctx: RankContext, init: RankInit) -> None:
        assert ctx.cpu_group is not None and ctx.device_group is not None
        self.ctx = ctx
        tp = TensorParallel(ctx.rank, ctx.world_size, ctx.device_group, init.ep_size, True)
        model = load_shard(init, ctx, tp)
        self.rank: DecodeRank = build_rank(init, ctx.device, model)
        self.rank.dp = DpAgreement(ctx.cpu_group)
        self._pull = Pull() if ctx.rank else None
        addresses = exchange_addresses(self._pull, ctx.rank, ctx.world_size, ctx.cpu_group)
        self._pushes = Pushes(addresses) if ctx.rank == 0 else None
        self._encoder = msgspec.msgpack.Encoder()
        self._order_decoder = msgspec.msgpack.Decoder(Order)
        self._report_decoder = msgspec.msgpack.Decoder(RankReport)
        self._peers_have_work = False  # from the last gathered state (rank 0)
        self._peers_due_mono = math.inf

    def warmup(self) -> None:
        self.rank.warmup()  # every rank at once: their agreements and idle steps line up

    def run_step(self, step: int, payloads: list[RankCommands]) -> DpReports:
        commands: list[list[Command]] = [[] for _ in range(self.ctx.world_size)]
        for payload in payloads:
            if not 0 <= payload.dp_rank < self.ctx.world_size:
                raise ValueError(f"a post for DP rank {payload.dp_rank} of {self.ctx.world_size}")
            commands[payload.dp_rank].extend(payload.commands)
        assert self._pushes is not None
        for follower, mine in enumerate(commands[1:]):
            self._pushes.send(self._encoder.encode(Order(step, tuple(mine))), to=follower)
        report = self.rank.execute(RankCommands(tuple(commands[0])))
        states = self._gather(report)
        assert states is not None
        now = time.monotonic()
        self._peers_have_work = any(has_work for _, has_work, _ in states[1:])
        self._peers_due_mono = min((now + due for _, _, due in states[1:]), default=math.inf)
        return DpReports((report, *(self._report_decoder.decode(raw) for raw, _, _ in states[1:])))

    def follow(self, timeout_s: float) -> None:
        assert self._pull is not None, "DP rank 0 leads: it does not follow"
        data = self._pull.receive(timeout_s)
        if data is None:
            return
        order = self._order_decoder.decode(data)
        self._gather(self.rank.execute(RankCommands(order.commands)))

    def _gather(self, report: RankReport) -> list[tuple[bytes, bool, float]] | None:
        """Every rank's (report, has work, seconds until its timer is due) at rank 0 (None on
        the others)."""
        raw = self._encoder.encode(report) if self.ctx.rank else b""
        state = (raw, self.rank.has_work, self.rank.seconds_until_due())
        states: list[tuple[bytes, bool, float]] | None = (
            [state] * self.ctx.world_size if self.ctx.rank == 0 else None
        )
        dist.gather_object(state, states, dst=0, group=self.ctx.cpu_group)
        return states

    def has_work(self) -> bool:
        return self.rank.has_work or self._peers_have_work

    def seconds_until_due(self) -> float:
        return min(self.rank.seconds_until_due(), self._peers_due_mono - time.monotonic())

    def on_failed(self, step: int, error: str) -> None:
        # the followers may be inside the step's collectives or past them: only a new group is
        # in step again
        raise RuntimeError(f"DP-attention decode step {step} failed ({error}): the group re-forms")

    def close(self) -> None:
        if self._pushes is not None:
            self._pushes.close()
        if self._pull is not None:
            self._pull.close()
        self.rank.receiver.close()
        if self.rank.gpu_share is not None:
            self.rank.gpu_share.close()
