"""Owner-elected encoding across the encoder's W ranks: owners, the leader's cache ledger, plans.

Every image has one owner, ``int(hash[:16], 16) % W``: only the owner encodes it (whole,
in its one ViT call of the step), caches it and sends its rows; a cache hit is served
from the owner's cache. So each distinct image is encoded once while it stays cached,
and W ranks hold W times the cache of one. While the owner does not serve (its rank
re-forms), the next serving rank after it (owner + 1, owner + 2, ... modulo W) stands
in: the plan names that rank as the span's owner, and it encodes, caches and sends.

The leader plans alone, from its ``CacheLedger`` (which rank holds which image), so the
ranks never decide anything that another rank waits on. The ledger is what the ranks
reported in their manifests after each step: the step's images each owner holds
afterwards and what it evicted. When a rank's cache disagrees with the ledger (a planned
hit is missing: a restarted rank, an eviction the leader did not hear of), the ledger
takes the rank's word and the affected calls are planned again, as encodes. A rank that
re-forms comes back with an empty cache: its entries alone are forgotten (``clear_rank``).

Each rank gets its share of the step only (``rank_payloads``): the jobs with a span it
owns, those spans, and the bytes of the images it encodes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

from services.vision_encoder.job import EncodeJob
from services.vision_encoder.rank_messages import (
    EncodeStepPayload,
    EncodeStepResult,
    RankJob,
    RankSpan,
    SpanAction,
)


def owner_rank(content_hash: str, world_size: int) -> int:
    """The rank that encodes and caches ``content_hash`` (its first 64 bits, modulo W)."""
    assert world_size > 0
    return int(content_hash[:16], 16) % world_size


def serving_owner(content_hash: str, world_size: int, serving: Collection[int]) -> int:
    """The owner if it serves, else the next serving rank after it; the owner if none serves."""
    owner = owner_rank(content_hash, world_size)
    for k in range(world_size):
        if (owner + k) % world_size in serving:
            return (owner + k) % world_size
    return owner


class SpanPlan(msgspec.Struct, frozen=True):
    content_hash: str
    owner_rank: int
    action: SpanAction


class EncodePlan(msgspec.Struct, frozen=True):
    world_size: int
    spans: tuple[SpanPlan, ...]  # one per span of the batch: jobs in order, spans in order

    def owned_hashes(self, rank: int) -> set[str]:
        return {s.content_hash for s in self.spans if s.owner_rank == rank}


class CacheLedger:
    """Which rank's cache holds which image, as the ranks last reported; the leader's only."""

    def __init__(self, world_size: int) -> None:
        assert world_size > 0
        self.world_size = world_size
        self._held: list[set[str]] = [set() for _ in range(world_size)]

    def holds(self, rank: int, content_hash: str) -> bool:
        return content_hash in self._held[rank]

    def update_from_results(self, plan: EncodePlan, results: Sequence[EncodeStepResult]) -> int:
        """Fold the manifests of the ranks that ran the step in (any subset, in rank order);
        returns how many planned hits a rank did not hold."""
        ranks = [r.rank for r in results]
        assert ranks == sorted(set(ranks)) and all(0 <= r < self.world_size for r in ranks)
        num_missing = 0
        for result in results:
            held, manifest = self._held[result.rank], result.manifest
            held.difference_update(manifest.evicted)
            held.difference_update(plan.owned_hashes(result.rank))
            held.update(manifest.held)
            num_missing += len(manifest.missing)
        return num_missing

    def clear_rank(self, rank: int) -> None:
        """Forget what ``rank`` held (it re-forms with an empty cache)."""
        self._held[rank].clear()


def make_plan(
    content_hashes: Sequence[str], ledger: CacheLedger, serving: Collection[int] | None = None
) -> EncodePlan:
    """Each span's owner (``serving_owner``; ``serving`` None: every rank serves); LOCAL_HIT
    where the ledger says that rank holds it, else OWNER_ENCODE."""
    world_size = ledger.world_size
    serving = range(world_size) if serving is None else serving
    spans = []
    for content_hash in content_hashes:
        owner = serving_owner(content_hash, world_size, serving)
        is_hit = ledger.holds(owner, content_hash)
        spans.append(
            SpanPlan(
                content_hash, owner, SpanAction.LOCAL_HIT if is_hit else SpanAction.OWNER_ENCODE
            )
        )
    return EncodePlan(ledger.world_size, tuple(spans))


def step_payload(jobs: Sequence[EncodeJob], plan: EncodePlan, now: float) -> EncodeStepPayload:
    """The whole step: the jobs with their spans' plans, and the bytes of each encode."""
    plans = iter(plan.spans)
    rank_jobs, images = [], {}
    for job in jobs:
        spans = []
        for i, span in enumerate(job.spans):
            span_plan = next(plans)
            assert span_plan.content_hash == span.span.content_hash
            if span_plan.action is SpanAction.OWNER_ENCODE and span.image_data:
                images[span_plan.content_hash] = span.image_data  # the scheduler saw one exists
            spans.append(
                RankSpan(
                    index=i,
                    content_hash=span_plan.content_hash,
                    grid_thw=span.span.grid_thw,
                    length=span.span.length,
                    dest_row=span.dest_row,
                    owner_rank=span_plan.owner_rank,
                    action=span_plan.action,
                )
            )
        rank_jobs.append(
            RankJob(
                job.job_id, job.request_id, job.deadline_mono - now, tuple(spans), job.destinations
            )
        )
    return EncodeStepPayload(tuple(rank_jobs), images)


def rank_payloads(payload: EncodeStepPayload) -> dict[int, EncodeStepPayload]:
    """Each owner's share of ``payload``, by rank (ascending): the jobs with a span it owns,
    those spans only, and the bytes of the images it encodes."""
    shares: dict[int, list[RankJob]] = {}
    for job in payload.jobs:
        by_rank: dict[int, list[RankSpan]] = {}
        for span in job.spans:
            by_rank.setdefault(span.owner_rank, []).append(span)
        for rank, spans in by_rank.items():
            shares.setdefault(rank, []).append(msgspec.structs.replace(job, spans=tuple(spans)))
    out = {}
    for rank in sorted(shares):
        jobs = tuple(shares[rank])
        encodes = {
            s.content_hash
            for job in jobs
            for s in job.spans
            if s.action is SpanAction.OWNER_ENCODE and s.content_hash in payload.images
        }
        out[rank] = EncodeStepPayload(jobs, {h: payload.images[h] for h in encodes})
    return out
