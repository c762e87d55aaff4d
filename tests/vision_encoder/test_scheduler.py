"""Encode batching bookkeeping and job validation, without a model or a server."""

from __future__ import annotations

import hashlib

import pytest

from services.common.clients.vision_encoder import EncodeSpanInput, SpanStatus
from services.common.errors import InvalidRequestError, UnavailableError
from services.common.types import ImageSpanRef
from services.transfer.embeddings import EmbeddingDestination
from services.vision_encoder.job import EncodeJob, JobLimits, validate_job
from services.vision_encoder.plan import Manifest, make_plan
from services.vision_encoder.scheduler import BatchResult, EncodeScheduler

DST = EmbeddingDestination("inprocess", "", "s", 0, 4096, 100, 256, 64, "float32")
LIMITS = JobLimits(merge_size=2, hidden_size=64, backend="inprocess")


def span(data: bytes, dest_row: int = 0, grid: tuple[int, int, int] = (1, 4, 6)) -> EncodeSpanInput:
    length = grid[0] * grid[1] * grid[2] // 4
    return EncodeSpanInput(ImageSpanRef(0, length, hashlib.sha256(data).hexdigest(), grid), data, dest_row)


def job(job_id: int, num_spans: int, deadline: float = 100.0) -> EncodeJob:
    spans = tuple(span(f"img-{job_id}-{i}".encode(), 6 * i) for i in range(num_spans))
    return EncodeJob(job_id, f"req-{job_id}", spans, (DST,), deadline)


def test_schedule_takes_the_oldest_jobs_that_fit() -> None:
    scheduler = EncodeScheduler(max_batch_images=4)
    for job_id, num_spans in enumerate([3, 1, 2, 9]):
        scheduler.add(job(job_id, num_spans))
    assert [j.job_id for j in scheduler.schedule(now=0).jobs] == [0, 1]
    assert [j.job_id for j in scheduler.schedule(now=0).jobs] == [2]
    assert [j.job_id for j in scheduler.schedule(now=0).jobs] == [3]  # too big for a batch: runs alone
    assert scheduler.num_waiting == 0 and scheduler.schedule(now=0).jobs == ()


def test_jobs_past_their_deadline_leave_as_expired() -> None:
    scheduler = EncodeScheduler(max_batch_images=8)
    scheduler.add(job(0, 1, deadline=5.0))
    scheduler.add(job(1, 1, deadline=50.0))
    batch = scheduler.schedule(now=10.0)
    assert [j.job_id for j in batch.expired] == [0] and [j.job_id for j in batch.jobs] == [1]


def test_update_from_output_marks_hits_repeats_and_errors() -> None:
    scheduler = EncodeScheduler(max_batch_images=8)
    a, b = job(0, 2), job(1, 1)
    b = EncodeJob(1, "req-1", (a.spans[0],), (DST,), 100.0)  # the same image as a's first span
    c = job(2, 1)
    for j in (a, b, c):
        scheduler.add(j)
    batch = scheduler.schedule(now=0)
    hashes = batch.content_hashes
    cached = {a.spans[1].span.content_hash}
    plan = make_plan(hashes, [Manifest(0, tuple(hashes), tuple(x in cached for x in hashes))], 1)
    error = UnavailableError("prefill is gone")
    outcomes = dict((j.job_id, o) for j, o in scheduler.update_from_output(batch, plan, BatchResult(errors={2: error})))
    assert [r.is_cache_hit for r in outcomes[0]] == [False, True]
    assert [r.is_cache_hit for r in outcomes[1]] == [True]  # rows reused from a's encode
    assert all(r.status is SpanStatus.WRITTEN and r.owner_rank == 0 for r in outcomes[0] + outcomes[1])
    assert outcomes[2] is error


def test_validate_job_accepts_a_good_job() -> None:
    validate_job(job(0, 3), LIMITS)


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda j: EncodeJob(0, "r", j.spans, (), 1.0), "embedding_refs"),
        (lambda j: EncodeJob(0, "r", (j.spans[0], span(b"x", dest_row=3)), (DST,), 1.0), "spans[1].dest_row"),
        (lambda j: EncodeJob(0, "r", (span(b"x", dest_row=95),), (DST,), 1.0), "spans[0].dest_row"),
        (lambda j: EncodeJob(0, "r", (span(b"x", grid=(1, 3, 6)),), (DST,), 1.0), "spans[0].span"),
    ],
    ids=["no-destination", "overlapping-rows", "rows-past-the-window", "odd-grid"],
)
def test_validate_job_names_the_bad_field(make, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_job(make(job(0, 2)), LIMITS)
    assert info.value.param == param
