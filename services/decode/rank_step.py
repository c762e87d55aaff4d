"""A decode rank process's step class (``services.decode.rank_step:DecodeRankStep``).

Built in each rank process by ``services.common.ranks.rank_main``: a ``DecodeRank`` on the
rank's device (``rank.py``), or, in a tensor-parallel group of T processes (``tp_rank.py``),
TP rank 0's ``DecodeRank`` mirroring its forwards, or a follower running them.
"""

from __future__ import annotations

import logging

from services.common.ranks.step import FreeRankStep, RankContext
from services.decode.messages import RankCommands, RankInit, RankReport
from services.decode.rank import build_rank
from services.decode.tp_rank import TpFollower, build_tp_rank

logger = logging.getLogger(__name__)


class DecodeRankStep(FreeRankStep):
    """The rank process's step: builds its ``DecodeRank`` on ``ctx.device`` from ``RankInit``.

    With ``init.tp_size`` T > 1 the group's T processes are one tensor-parallel decode rank:
    process 0 runs the ``DecodeRank`` and mirrors each forward to processes 1 .. T-1
    (``tp_mirror.py``), which run it on their shards (``follow``)."""

    init_type = RankInit
    payload_type = RankCommands
    result_type = RankReport

    def __init__(self, ctx: RankContext, init: RankInit) -> None:
        self.follower: TpFollower | None = None
        if init.tp_size == 1:
            self.rank = build_rank(init, ctx.device)
        elif ctx.rank == 0:
            self.rank = build_tp_rank(init, ctx)
        else:
            self.follower = TpFollower(init, ctx)

    def warmup(self) -> None:
        if self.follower is not None:
            self.follower.warmup()
            return
        self.rank.warmup()
        mirror = self.rank.loop.batch.mirror
        if mirror is not None:
            mirror.warmup_done()

    def run_step(self, step: int, payloads: list[RankCommands]) -> RankReport:
        return self.rank.execute(RankCommands(tuple(c for p in payloads for c in p.commands)))

    def follow(self, timeout_s: float) -> None:
        assert self.follower is not None, "TP rank 0 leads: it does not follow"
        self.follower.follow(timeout_s)

    def has_work(self) -> bool:
        return self.rank.has_work

    def seconds_until_due(self) -> float:
        return self.rank.seconds_until_due()

    def on_failed(self, step: int, error: str) -> None:
        logger.error("step %d failed, every request of this rank ends: %s", step, error)
        if self.rank.loop.batch.mirror is not None:
            # the followers may be mid-forward or past it: only a new group is in step again
            raise RuntimeError(f"tensor-parallel decode step {step} failed: the group re-forms")
        self.rank.reset()

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
            return
        self.rank.receiver.close()
        if self.rank.loop.batch.mirror is not None:
            self.rank.loop.batch.mirror.close()
        if self.rank.gpu_share is not None:
            self.rank.gpu_share.close()
