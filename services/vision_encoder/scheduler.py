"""Encode batching on the leader: CPU bookkeeping only (no model, no sockets).

Lifecycle of an Encode call:
  servicer: proto -> EncodeJob, validate_job -> leader.encode(job) -> scheduler.add   WAITING (FIFO)
  schedule(now): jobs past their deadline leave as ``expired``; the oldest waiting jobs
      join one EncodeBatch while their spans fit ``max_batch_images`` (the first always does)
  leader: every rank's manifest -> make_plan -> worker.execute(batch, plan) -> BatchResult
  update_from_output(batch, plan, result): every job of the batch is FINISHED, with its
      per-span results or its error; nothing stays in flight.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.clients.vision_encoder import SpanResult, SpanStatus
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.plan import EncodePlan, SpanAction

JobOutcome = list[SpanResult] | BaseException  # a job's span results, or the error it fails with


@dataclass(frozen=True)
class EncodeBatch:
    jobs: tuple[EncodeJob, ...]
    expired: tuple[EncodeJob, ...] = ()

    @property
    def content_hashes(self) -> list[str]:
        """Every span's hash, jobs in order, spans in order (the plan's span order)."""
        return [s.span.content_hash for job in self.jobs for s in job.spans]


@dataclass
class BatchResult:
    errors: dict[int, BaseException] = field(default_factory=dict)  # job_id -> why it failed
    num_images_encoded: int = 0
    num_vit_forwards: int = 0
    vit_s: float = 0.0
    num_bytes_sent: int = 0


class EncodeScheduler:
    def __init__(self, max_batch_images: int) -> None:
        assert max_batch_images > 0
        self.max_batch_images = max_batch_images
        self._waiting: deque[EncodeJob] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, job: EncodeJob) -> None:
        self._waiting.append(job)

    def drain(self) -> list[EncodeJob]:
        """Remove and return every waiting job (shutdown)."""
        jobs, self._waiting = list(self._waiting), deque()
        return jobs

    def schedule(self, now: float) -> EncodeBatch:
        jobs: list[EncodeJob] = []
        expired: list[EncodeJob] = []
        num_images = 0
        while self._waiting:
            job = self._waiting[0]
            if job.deadline <= now:
                expired.append(self._waiting.popleft())
                continue
            if jobs and num_images + len(job.spans) > self.max_batch_images:
                break
            jobs.append(self._waiting.popleft())
            num_images += len(job.spans)
        return EncodeBatch(tuple(jobs), tuple(expired))

    def update_from_output(
        self, batch: EncodeBatch, plan: EncodePlan, result: BatchResult
    ) -> list[tuple[EncodeJob, JobOutcome]]:
        """Each job's outcome. A span is a cache hit when its rows needed no ViT run of their own:
        cached on its owner, or a repeat of an image encoded earlier in the same batch."""
        outcomes: list[tuple[EncodeJob, JobOutcome]] = []
        seen: set[str] = set()
        plans = iter(plan.spans)
        for job in batch.jobs:
            results = []
            for span in job.spans:
                span_plan = next(plans)
                assert span_plan.content_hash == span.span.content_hash
                is_hit = span_plan.action is SpanAction.LOCAL_HIT or span_plan.content_hash in seen
                seen.add(span_plan.content_hash)
                results.append(SpanResult(span_plan.content_hash, SpanStatus.WRITTEN, is_hit, span_plan.owner_rank))
            error = result.errors.get(job.job_id)
            outcomes.append((job, error if error is not None else results))
        return outcomes

