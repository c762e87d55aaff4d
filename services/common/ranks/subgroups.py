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
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
        _new_group([o * inner_size + i for i in range(inner_size)], ctx.device, ctx.host, timeout)
        for o in range(outer_size)
    ]
    outer_device = "cpu" if outer_over_cpu else ctx.device
    outer = [
        _new_group([o * inner_size + i for o in range(outer_size)], outer_device, ctx.host, timeout)
        for i in range(inner_size)
    ]
    return Subgroups(
        inner_rank, inner_size, inner[outer_rank], outer_rank, outer_size, outer[inner_rank]
    )


def _new_group(
    ranks: list[int], device: str, host: str, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    if device.startswith("cuda"):
        group = dist.new_group(ranks, backend="nccl", timeout=timeout)
    else:
        from services.common.ranks.rank_main import gloo_options

        group = dist.new_group(
            ranks, backend="gloo", timeout=timeout, pg_options=gloo_options(host)
        )
    assert group is not None
    return group


def model_manifest(model_dir: str | Path, **layout: object) -> dict[str, object]:
    """What the ranks of one group must agree on: the checkpoint's config and weight index
    (digests of the files as this rank reads them) and ``layout`` (sizes, dtype, ...)."""
    manifest: dict[str, object] = dict(layout)
    for name in ("config.json", "model.safetensors.index.json"):
        path = Path(model_dir) / name
        if path.is_file():
            manifest[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return manifest


def disagreement(manifests: Sequence[dict[str, object]]) -> str | None:
    """The first way a rank's manifest differs from rank 0's, naming the rank; None: agreed."""
    first = manifests[0]
    for rank, manifest in enumerate(manifests[1:], start=1):
        for key in sorted(first.keys() | manifest.keys()):
            if first.get(key) != manifest.get(key):
                return (
                    f"rank {rank} disagrees with rank 0 about {key}: "
                    f"{manifest.get(key)!r} against {first.get(key)!r}"
                )
    return None


def agree_on_manifest(ctx: RankContext, manifest: dict[str, object]) -> None:
    """Every rank's ``manifest`` all-gathered over the CPU group; ``ValueError`` on every rank,
    naming the rank, unless they are all equal (a group that would run different models or
    layouts refuses to form). A world of one has nobody to disagree with."""
    if ctx.world_size == 1:
        return
    manifests: list[dict[str, object]] = [{}] * ctx.world_size
    dist.all_gather_object(manifests, manifest, group=ctx.cpu_group)
    problem = disagreement(manifests)
    if problem is not None:
        raise ValueError(f"the rank group cannot form: {problem}")
