"""Owner-elected encoding plan for a batch of image spans across the encoder's W ranks.

Each rank reports a manifest: for the batch's span hashes (same list, same order on
every rank), which ones its cache holds. The leader checks the manifests agree and
plans every span: its owner is ``int(hash[:16], 16) % W``; the action is LOCAL_HIT
when the owner's cache holds it (the owner sends cached rows) else OWNER_ENCODE (the
owner runs the ViT once per distinct image, then sends). Only owners cache an image,
so a rank reporting a hash it does not own means the ranks diverged: the plan fails.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from services.common.errors import StageServeError


class PlanError(StageServeError):
    """The ranks' manifests disagree; no plan is safe to execute."""


class SpanAction(enum.Enum):
    LOCAL_HIT = "local_hit"
    OWNER_ENCODE = "owner_encode"


class Manifest(msgspec.Struct, frozen=True):
    rank: int
    content_hashes: tuple[str, ...]  # the batch's span hashes as this rank saw them
    is_cached: tuple[bool, ...]  # per hash: held in this rank's cache


class SpanPlan(msgspec.Struct, frozen=True):
    content_hash: str
    owner_rank: int
    action: SpanAction


class EncodePlan(msgspec.Struct, frozen=True):
    world_size: int
    spans: tuple[SpanPlan, ...]  # one per batch span, same order

    def encode_hashes(self, rank: int) -> list[str]:
        """Distinct images ``rank`` must encode, in first-appearance order (one ViT call)."""
        hashes = (s.content_hash for s in self.spans if s.owner_rank == rank and s.action is SpanAction.OWNER_ENCODE)
        return list(dict.fromkeys(hashes))

    def hit_hashes(self, rank: int) -> list[str]:
        hashes = (s.content_hash for s in self.spans if s.owner_rank == rank and s.action is SpanAction.LOCAL_HIT)
        return list(dict.fromkeys(hashes))


def owner_rank(content_hash: str, world_size: int) -> int:
    """The rank that encodes and caches ``content_hash`` (its first 64 bits, modulo W)."""
    assert world_size > 0
    return int(content_hash[:16], 16) % world_size


def make_plan(content_hashes: Sequence[str], manifests: Sequence[Manifest], world_size: int) -> EncodePlan:
    """Plan every span of a batch; ``PlanError`` when the manifests do not agree."""
    check_manifests(content_hashes, manifests, world_size)
    by_rank = {m.rank: m for m in manifests}
    spans = []
    for i, content_hash in enumerate(content_hashes):
        owner = owner_rank(content_hash, world_size)
        action = SpanAction.LOCAL_HIT if by_rank[owner].is_cached[i] else SpanAction.OWNER_ENCODE
        spans.append(SpanPlan(content_hash, owner, action))
    return EncodePlan(world_size, tuple(spans))


def check_manifests(content_hashes: Sequence[str], manifests: Sequence[Manifest], world_size: int) -> None:
    ranks = sorted(m.rank for m in manifests)
    if ranks != list(range(world_size)):
        raise PlanError(f"expected one manifest per rank 0..{world_size - 1}, got ranks {ranks}")
    expected = tuple(content_hashes)
    for m in manifests:
        if m.content_hashes != expected or len(m.is_cached) != len(expected):
            raise PlanError(f"rank {m.rank}'s manifest lists a different batch than the leader's")
        for content_hash, is_cached in zip(m.content_hashes, m.is_cached, strict=True):
            if is_cached and owner_rank(content_hash, world_size) != m.rank:
                raise PlanError(
                    f"rank {m.rank} caches {content_hash[:16]}..., owned by rank "
                    f"{owner_rank(content_hash, world_size)}: the ranks' caches diverged"
                )
