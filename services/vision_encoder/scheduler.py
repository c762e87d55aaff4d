"""Encode batching on the leader: CPU bookkeeping only (no model, no sockets, no device).

Lifecycle of an Encode call:
  servicer: proto -> EncodeJob, validate_job -> leader.encode(job) -> scheduler.add   WAITING (FIFO)
  schedule(now, ledger, serving): jobs past their deadline leave as ``expired``; the oldest
      waiting jobs join one EncodeBatch while their spans fit ``max_batch_images`` (the
      first always does), planned from the ledger over the serving ranks
      (``plan.make_plan``); a job with a span sent without bytes that its plan must encode,
      and that no job of the batch brings bytes for, leaves as ``needs_data`` (FINISHES at
      once: NEEDS_IMAGE_DATA, nothing written)
  leader: one step on each rank that owns a span of the batch, all at once -> each rank's
      EncodeStepResult, or that rank's step error
  update_from_output(batch, results, failed): a job with a span on a rank whose step failed,
      or that a rank failed, FINISHES with the error of the lowest such rank; a job with a
      planned hit that its owner did not hold goes back to the head of the queue (WAITING,
      planned again from the corrected ledger, at most ``MAX_REPLANS`` times); every other
      job FINISHES with its span results.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from services.common.clients.vision_encoder import SpanResult, SpanStatus
from services.common.errors import UnavailableError
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.plan import CacheLedger, EncodePlan, SpanPlan, make_plan
from services.vision_encoder.rank_messages import EncodeStepResult, JobError, SpanAction

MAX_REPLANS = 2  # a cache that keeps losing planned hits is a fault, not a reason to loop
JobOutcome = list[SpanResult] | BaseException  # a job's span results, or the error it fails with


@dataclass(frozen=True)
class EncodeBatch:
    jobs: tuple[EncodeJob, ...]
    plan: EncodePlan
    expired: tuple[EncodeJob, ...] = ()
    needs_data: tuple[tuple[EncodeJob, list[SpanResult]], ...] = ()


@dataclass
class BatchOutcome:
    finished: list[tuple[EncodeJob, JobOutcome]] = field(default_factory=list)
    replanned: list[EncodeJob] = field(default_factory=list)


class EncodeScheduler:
    def __init__(self, max_batch_images: int) -> None:
        assert max_batch_images > 0
        self.max_batch_images = max_batch_images
        self._waiting: deque[EncodeJob] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def saturation(self) -> float:
        """How full the encoder is, 0..1: the images waiting for a batch over
        ``max_batch_images`` (at 1 a whole batch waits behind the one running)."""
        num_images = sum(len(job.spans) for job in self._waiting)
        return min(1.0, num_images / self.max_batch_images)

    def add(self, job: EncodeJob) -> None:
        self._waiting.append(job)

    def requeue(self, jobs: Sequence[EncodeJob]) -> None:
        """Put ``jobs`` back at the head of the queue, in their order."""
        self._waiting.extendleft(reversed(jobs))

    def drain(self) -> list[EncodeJob]:
        """Remove and return every waiting job (shutdown)."""
        jobs, self._waiting = list(self._waiting), deque()
        return jobs

    def schedule(
        self, now: float, ledger: CacheLedger, serving: Collection[int] | None = None
    ) -> EncodeBatch:
        """The next batch; ``serving``: the ranks that serve (None: every rank)."""
        jobs: list[EncodeJob] = []
        expired: list[EncodeJob] = []
        num_images = 0
        while self._waiting:
            job = self._waiting[0]
            if job.deadline_mono <= now:
                expired.append(self._waiting.popleft())
                continue
            if jobs and num_images + len(job.spans) > self.max_batch_images:
                break
            jobs.append(self._waiting.popleft())
            num_images += len(job.spans)
        plan = make_plan([s.span.content_hash for job in jobs for s in job.spans], ledger, serving)
        needs_data = _needing_data(jobs, plan)
        if needs_data:
            held = {id(job) for job, _ in needs_data}
            jobs = [job for job in jobs if id(job) not in held]
            hashes = [s.span.content_hash for job in jobs for s in job.spans]
            plan = make_plan(hashes, ledger, serving)
        return EncodeBatch(tuple(jobs), plan, tuple(expired), tuple(needs_data))

    def update_from_output(
        self,
        batch: EncodeBatch,
        results: Sequence[EncodeStepResult],
        failed: Mapping[int, BaseException] | None = None,
    ) -> BatchOutcome:
        """Each job's outcome (see the module docstring); ``results``: the ranks whose step
        ran, ``failed``: each rank whose step failed, with its error. A span is a cache hit
        when its rows needed no ViT run of their own: cached on its owner, or a repeat of an
        image encoded earlier in the same batch."""
        errors: dict[int, dict[int, JobError]] = {}  # job_id -> rank -> its error there
        missing: dict[str, int] = {}  # planned hit the owner did not hold -> that owner
        for result in results:
            for error in result.errors:
                errors.setdefault(error.job_id, {}).setdefault(result.rank, error)
            missing.update(dict.fromkeys(result.manifest.missing, result.rank))
        failed = failed or {}
        outcome = BatchOutcome()
        seen: set[str] = set()
        plans = iter(batch.plan.spans)
        for job in batch.jobs:
            span_plans = [next(plans) for _ in job.spans]
            lost = [p for p in span_plans if p.content_hash in missing]
            ranks = {p.owner_rank for p in span_plans}
            error = _first_error(ranks, errors.get(job.job_id, {}), failed)
            if error is not None:
                outcome.finished.append((job, error))
            elif lost and job.num_replans >= MAX_REPLANS:
                ranks = sorted({missing[p.content_hash] for p in lost})
                outcome.finished.append((job, _lost_again(job, ranks)))
            elif lost:
                replanned = msgspec.structs.replace(job, num_replans=job.num_replans + 1)
                outcome.replanned.append(replanned)
            else:
                outcome.finished.append((job, _span_results(span_plans, seen)))
            seen.update(p.content_hash for p in span_plans)
        return outcome


def _first_error(
    ranks: set[int], errors: Mapping[int, JobError], failed: Mapping[int, BaseException]
) -> BaseException | None:
    """A job's error: the lowest rank's that failed the job (``errors``), or failed its step
    while the job had a span on it (``ranks``); None when no rank did."""
    candidates = ranks & failed.keys() | errors.keys()
    if not candidates:
        return None
    rank = min(candidates)
    return errors[rank].error.to_error() if rank in errors else failed[rank]


def _needing_data(
    jobs: Sequence[EncodeJob], plan: EncodePlan
) -> list[tuple[EncodeJob, list[SpanResult]]]:
    """The jobs that must encode an image nobody in the batch sent bytes for, with their
    results: NEEDS_IMAGE_DATA for those spans, SKIPPED for the rest."""
    brought = {s.span.content_hash for job in jobs for s in job.spans if s.image_data}
    out, plans = [], iter(plan.spans)
    for job in jobs:
        span_plans = [next(plans) for _ in job.spans]
        lacking = [
            p.action is SpanAction.OWNER_ENCODE and p.content_hash not in brought
            for p in span_plans
        ]
        if any(lacking):
            out.append(
                (
                    job,
                    [
                        _unwritten(p, is_lacking)
                        for p, is_lacking in zip(span_plans, lacking, strict=True)
                    ],
                )
            )
    return out


def _unwritten(plan: SpanPlan, is_lacking: bool) -> SpanResult:
    status = SpanStatus.NEEDS_IMAGE_DATA if is_lacking else SpanStatus.SKIPPED
    return SpanResult(plan.content_hash, status, False, plan.owner_rank)


def _span_results(span_plans: Sequence, seen: set[str]) -> list[SpanResult]:
    results, local_seen = [], set(seen)
    for plan in span_plans:
        is_hit = plan.action is SpanAction.LOCAL_HIT or plan.content_hash in local_seen
        local_seen.add(plan.content_hash)
        results.append(SpanResult(plan.content_hash, SpanStatus.WRITTEN, is_hit, plan.owner_rank))
    return results


def _lost_again(job: EncodeJob, ranks: list[int]) -> UnavailableError:
    who = ", ".join(str(r) for r in ranks)
    return UnavailableError(
        f"encode of {job.request_id}: the cache of encoder rank {who} lost planned hits "
        f"{job.num_replans + 1} times"
    )
