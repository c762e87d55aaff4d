"""The CP ranks' lockstep when an MoE model's experts split over them (``--tp 1 --ep C``).

Each CP rank then holds attention, the embedding and the LM head whole and 1/C of every MoE
layer's experts (``TensorParallel.dp_attention`` over the CP group): each layer's MLP runs on
every rank's rows all-gathered, each rank's padded to the pass's agreed rows (``mlp_rows``).
So every rank runs every pass of every plan, in order, with the same agreed rows: the most
tokens any rank computes in that pass, which each rank reads off the plan it was handed (the
same plan on every rank: ``PrefillRankStep`` checks its digest), with no collective. A rank
with no tokens in a pass (a plan another rank runs alone) joins each layer's gather with none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine import ops
from services.engine.attention.context_parallel import CpShard
from services.engine.model_runner import ModelRunner
from services.prefill.messages import SHARDED, PassSegment, RankPlan


def pass_rows(plan: RankPlan, segments: Sequence[PassSegment], num_ranks: int) -> int:
    """The most tokens any of ``num_ranks`` CP ranks computes in the pass ``segments`` of
    ``plan``: its share of a sharded pass, or the whole pass (the rank that runs it alone)."""
    num_tokens = sum(s.end - s.start for s in segments)
    if plan.solo_rank != SHARDED or num_ranks == 1:
        return num_tokens
    return max(CpShard(0, num_ranks, plan.block_tokens).sizes(num_tokens))


class ExpertLockstep:
    """One CP rank's part in the lockstep of ``num_ranks`` ranks (module docstring)."""

    def __init__(self, runner: ModelRunner, num_ranks: int) -> None:
        self.runner, self.num_ranks = runner, num_ranks

    def begin_pass(self, plan: RankPlan, segments: Sequence[PassSegment]) -> None:
        """Agree the rows of the pass about to run (every rank calls it with the same pass)."""
        self.runner.set_dp_rows(pass_rows(plan, segments, self.num_ranks))

    @torch.inference_mode()
    def idle(self, plan: RankPlan) -> None:
        """This rank's part of a plan another rank runs alone: every pass's MLP gathers, with
        no rows of its own."""
        runner = self.runner
        with ops.on_device(runner.device):
            for segments in plan.passes:
                self.begin_pass(plan, segments)
                runner.model.model.idle(runner.dtype, runner.device)


def expert_lockstep(runner: ModelRunner, num_ranks: int) -> ExpertLockstep | None:
    """The lockstep when ``runner``'s model splits its experts over the ``num_ranks`` CP
    ranks (DP attention over them); None otherwise."""
    split = runner.model.tp
    if not split.dp_attention or split.size == 1:
        return None
    assert split.size == num_ranks, f"experts over {split.size} of {num_ranks} CP ranks"
    return ExpertLockstep(runner, num_ranks)
