"""A stepped group's world as ``outer_size`` groups of ``inner_size`` ranks: rank ``r`` is rank
``r % inner_size`` of inner group ``r // inner_size`` (prefill: a CP rank's tensor-parallel
group, its ranks adjacent so they share a host's fastest links) and rank ``r // inner_size``
of outer group ``r % inner_size`` (prefill: the CP ranks that hold the same heads).

Every rank creates every subgroup, in the same order (``torch.distributed.new_group`` is
collective over the world); a subgroup that would be the whole world is the world's own group.
Gloo groups listen on loopback only, as the world's do (``rank_main``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from services.common.ranks.step import RankContext


@dataclass(frozen=True)
class Subgroups:
    inner_rank: int
    inner_size: int
    inner_group: dist.ProcessGroup | None  # tensors (the device's backend); None: a group of one
    outer_rank: int
    outer_size: int
    outer_group: dist.ProcessGroup | None  # tensors, or CPU tensors with ``outer_over_cpu``


def split_world(ctx: RankContext, inner_size: int, outer_over_cpu: bool = False) -> Subgroups:
    """This rank's inner and outer groups; ``outer_over_cpu``: the outer group is gloo (ranks
    that share a GPU, where NCCL cannot run)."""
    assert ctx.world_size % inner_size == 0, (ctx.world_size, inner_size)
    outer_size = ctx.world_size // inner_size
    outer_rank, inner_rank = divmod(ctx.rank, inner_size)
    world_outer = ctx.cpu_group if outer_over_cpu else ctx.device_group
    if inner_size == 1:
        return Subgroups(0, 1, None, outer_rank, outer_size, world_outer)
    if outer_size == 1:
        return Subgroups(inner_rank, inner_size, ctx.device_group, 0, 1, None)
    timeout = datetime.timedelta(seconds=ctx.collective_timeout_s)
    inner = [
        _new_group([o * inner_size + i for i in range(inner_size)], ctx.device, timeout)
        for o in range(outer_size)
    ]
    outer_device = "cpu" if outer_over_cpu else ctx.device
    outer = [
        _new_group([o * inner_size + i for o in range(outer_size)], outer_device, timeout)
        for i in range(inner_size)
    ]
    return Subgroups(
        inner_rank, inner_size, inner[outer_rank], outer_rank, outer_size, outer[inner_rank]
    )


def _new_group(ranks: list[int], device: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    if device.startswith("cuda"):
        group = dist.new_group(ranks, backend="nccl", timeout=timeout)
    else:
        from services.common.ranks.rank_main import loopback_gloo_options

        group = dist.new_group(
            ranks, backend="gloo", timeout=timeout, pg_options=loopback_gloo_options()
        )
    assert group is not None
    return group
