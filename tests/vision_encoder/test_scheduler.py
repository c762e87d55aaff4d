"""Encode batching bookkeeping and job validation, without a model, a rank or a server."""

from __future__ import annotations

import hashlib

import pytest

from services.common.clients.vision_encoder import EncodeSpanInput, SpanStatus
from services.common.destinations import EmbeddingDestination
from services.common.errors import ErrorRecord, InvalidRequestError, UnavailableError
from services.common.types import ImageSpanRef
from services.vision_encoder.job import EncodeJob, JobLimits, validate_job
from services.vision_encoder.plan import CacheLedger, owner_rank, rank_payloads, step_payload
from services.vision_encoder.rank_messages import (
    EncodeStepResult,
    JobError,
    RankManifest,
    SpanAction,
)
from services.vision_encoder.scheduler import MAX_REPLANS, EncodeScheduler

DST = EmbeddingDestination("shm", "", "s", 0, 4096, 100, 256, 64, "float32")
LIMITS = JobLimits(merge_size=2, hidden_size=64, backend="shm")


def span(data: bytes, dest_row: int = 0, grid: tuple[int, int, int] = (1, 4, 6)) -> EncodeSpanInput:
    length = grid[0] * grid[1] * grid[2] // 4
    return EncodeSpanInput(
        ImageSpanRef(0, length, hashlib.sha256(data).hexdigest(), grid), data, dest_row
    )


def job(job_id: int, num_spans: int, deadline_mono: float = 100.0) -> EncodeJob:
    spans = tuple(span(f"img-{job_id}-{i}".encode(), 6 * i) for i in range(num_spans))
    return EncodeJob(job_id, f"req-{job_id}", spans, (DST,), deadline_mono)


def results(world_size: int, **by_rank) -> list[EncodeStepResult]:
    """Every rank's result; ``by_rank``: ``r1=EncodeStepResult(...)`` replaces rank 1's."""
    return [by_rank.get(f"r{r}", EncodeStepResult(r)) for r in range(world_size)]


def test_schedule_takes_the_oldest_jobs_that_fit() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=4), CacheLedger(1)
    for job_id, num_spans in enumerate([3, 1, 2, 9]):
        scheduler.add(job(job_id, num_spans))
    assert [j.job_id for j in scheduler.schedule(0, ledger).jobs] == [0, 1]
    assert [j.job_id for j in scheduler.schedule(0, ledger).jobs] == [2]
    assert [j.job_id for j in scheduler.schedule(0, ledger).jobs] == [
        3
    ]  # too big for a batch: alone
    assert scheduler.num_waiting == 0 and scheduler.schedule(0, ledger).jobs == ()


def test_saturation_is_the_images_waiting_over_one_batch() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=4), CacheLedger(1)
    assert scheduler.saturation == 0.0
    scheduler.add(job(0, 1))
    scheduler.add(job(1, 2))
    assert scheduler.saturation == pytest.approx(3 / 4)
    scheduler.add(job(2, 3))
    assert scheduler.saturation == 1.0  # six images: more than a batch waits
    assert [j.job_id for j in scheduler.schedule(0, ledger).jobs] == [0, 1]
    assert scheduler.saturation == pytest.approx(3 / 4)
    scheduler.schedule(0, ledger)
    assert scheduler.saturation == 0.0


def test_jobs_past_their_deadline_leave_as_expired() -> None:
    scheduler = EncodeScheduler(max_batch_images=8)
    scheduler.add(job(0, 1, deadline_mono=5.0))
    scheduler.add(job(1, 1, deadline_mono=50.0))
    batch = scheduler.schedule(now=10.0, ledger=CacheLedger(1))
    assert [j.job_id for j in batch.expired] == [0] and [j.job_id for j in batch.jobs] == [1]


def test_update_from_output_marks_hits_repeats_and_errors() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=8), CacheLedger(2)
    a = job(0, 2)
    b = EncodeJob(1, "req-1", (a.spans[0],), (DST,), 100.0)  # the same image as a's first span
    c = job(2, 1)
    for j in (a, b, c):
        scheduler.add(j)
    batch = scheduler.schedule(0, ledger)
    bad = JobError(
        2,
        ErrorRecord(
            "InvalidRequestError", "spans[0].image_data: not an image", "spans[0].image_data"
        ),
    )
    later = JobError(2, ErrorRecord("UnavailableError", "prefill is gone"))
    outcome = scheduler.update_from_output(
        batch,
        results(2, r0=EncodeStepResult(0, errors=(bad,)), r1=EncodeStepResult(1, errors=(later,))),
    )
    outcomes = {j.job_id: o for j, o in outcome.finished}
    assert [r.is_cache_hit for r in outcomes[0]] == [False, False]
    assert [r.is_cache_hit for r in outcomes[1]] == [True]  # rows reused from a's encode
    assert all(r.status is SpanStatus.WRITTEN for r in outcomes[0] + outcomes[1])
    owners = [owner_rank(s.span.content_hash, 2) for s in a.spans]
    assert [r.owner_rank for r in outcomes[0]] == owners
    error = outcomes[2]
    assert (
        isinstance(error, InvalidRequestError) and error.param == "spans[0].image_data"
    )  # lowest rank's
    assert outcome.replanned == []


def test_a_missing_planned_hit_plans_its_job_again_until_the_bound() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=8), CacheLedger(1)
    lost, fine = job(0, 2), job(1, 1)
    scheduler.add(lost)
    scheduler.add(fine)
    gone = lost.spans[1].span.content_hash
    missing = EncodeStepResult(0, manifest=RankManifest((), (), (gone,)))
    for attempt in range(MAX_REPLANS):
        batch = scheduler.schedule(0, ledger)
        outcome = scheduler.update_from_output(batch, [missing])
        assert [j.job_id for j in outcome.replanned] == [0]
        assert outcome.replanned[0].num_replans == attempt + 1
        assert [j.job_id for j, _ in outcome.finished] == ([1] if attempt == 0 else [])
        scheduler.requeue(outcome.replanned)
    scheduler.add(job(2, 1))
    batch = scheduler.schedule(0, ledger)
    assert [j.job_id for j in batch.jobs] == [0, 2]  # the replanned job went back to the head
    outcome = scheduler.update_from_output(batch, [missing])
    error = dict((j.job_id, o) for j, o in outcome.finished)[0]
    assert isinstance(error, UnavailableError) and "lost planned hits 3 times" in error.message


def test_validate_job_accepts_a_good_job() -> None:
    validate_job(job(0, 3), LIMITS)


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda j: EncodeJob(0, "r", j.spans, (), 1.0), "embedding_refs"),
        (
            lambda j: EncodeJob(0, "r", (j.spans[0], span(b"x", dest_row=3)), (DST,), 1.0),
            "spans[1].dest_row",
        ),
        (lambda j: EncodeJob(0, "r", (span(b"x", dest_row=95),), (DST,), 1.0), "spans[0].dest_row"),
        (lambda j: EncodeJob(0, "r", (span(b"x", grid=(1, 3, 6)),), (DST,), 1.0), "spans[0].span"),
    ],
    ids=["no-destination", "overlapping-rows", "rows-past-the-window", "odd-grid"],
)
def test_validate_job_names_the_bad_field(make, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_job(make(job(0, 2)), LIMITS)
    assert info.value.param == param


def without_bytes(s: EncodeSpanInput) -> EncodeSpanInput:
    return EncodeSpanInput(s.span, b"", s.dest_row)


def test_a_span_without_bytes_is_served_from_the_cache_the_ledger_names() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=8), CacheLedger(2)
    sent = job(0, 1)
    scheduler.add(sent)
    first = scheduler.schedule(0, ledger)
    owner = first.plan.spans[0].owner_rank
    manifest = RankManifest((sent.spans[0].span.content_hash,), (), ())
    ledger.update_from_results(
        first.plan, results(2, **{f"r{owner}": EncodeStepResult(owner, manifest=manifest)})
    )
    light = EncodeJob(1, "req-1", (without_bytes(sent.spans[0]),), (DST,), 100.0)
    scheduler.add(light)
    batch = scheduler.schedule(0, ledger)
    assert [j.job_id for j in batch.jobs] == [1] and batch.needs_data == ()
    assert [p.action for p in batch.plan.spans] == [SpanAction.LOCAL_HIT]
    assert step_payload(batch.jobs, batch.plan, 0).images == {}


def test_a_span_without_bytes_nobody_holds_needs_its_data_and_nothing_runs() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=8), CacheLedger(2)
    fresh = job(0, 2)
    light = EncodeJob(0, "req-0", (fresh.spans[0], without_bytes(fresh.spans[1])), (DST,), 100.0)
    other = job(1, 1)
    scheduler.add(light)
    scheduler.add(other)
    batch = scheduler.schedule(0, ledger)
    assert [j.job_id for j in batch.jobs] == [1]  # its neighbour runs
    assert [p.content_hash for p in batch.plan.spans] == [other.spans[0].span.content_hash]
    ((needing, span_results),) = batch.needs_data
    assert needing is light
    assert [r.status for r in span_results] == [SpanStatus.SKIPPED, SpanStatus.NEEDS_IMAGE_DATA]
    assert [r.content_hash for r in span_results] == [s.span.content_hash for s in light.spans]


def test_a_span_without_bytes_rides_on_a_batch_neighbour_that_brings_them() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=8), CacheLedger(1)
    sent = job(0, 1)
    light = EncodeJob(1, "req-1", (without_bytes(sent.spans[0]),), (DST,), 100.0)
    scheduler.add(light)  # first in the queue, without bytes
    scheduler.add(sent)
    batch = scheduler.schedule(0, ledger)
    assert [j.job_id for j in batch.jobs] == [1, 0] and batch.needs_data == ()
    payload = step_payload(batch.jobs, batch.plan, 0)
    assert payload.images == {sent.spans[0].span.content_hash: sent.spans[0].image_data}


def test_a_span_without_bytes_whose_planned_hit_was_lost_needs_its_data() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=8), CacheLedger(1)
    sent = job(0, 1)
    content_hash = sent.spans[0].span.content_hash
    ledger.update_from_results(
        scheduler.schedule(0, ledger).plan,
        results(1, r0=EncodeStepResult(0, manifest=RankManifest((content_hash,), (), ()))),
    )
    scheduler.add(EncodeJob(1, "req-1", (without_bytes(sent.spans[0]),), (DST,), 100.0))
    batch = scheduler.schedule(0, ledger)
    assert [p.action for p in batch.plan.spans] == [SpanAction.LOCAL_HIT]
    lost = results(1, r0=EncodeStepResult(0, manifest=RankManifest((), (), (content_hash,))))
    ledger.update_from_results(batch.plan, lost)
    outcome = scheduler.update_from_output(batch, lost)
    scheduler.requeue(outcome.replanned)
    again = scheduler.schedule(0, ledger)
    assert again.jobs == ()
    assert [r.status for r in again.needs_data[0][1]] == [SpanStatus.NEEDS_IMAGE_DATA]


def test_a_span_without_bytes_is_not_hash_checked() -> None:
    validate_job(EncodeJob(0, "r", (without_bytes(span(b"x")),), (DST,), 100.0), LIMITS)


def test_a_failed_rank_fails_only_the_jobs_with_a_span_on_it() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=16), CacheLedger(2)
    jobs = [job(i, 3) for i in range(5)]
    for j in jobs:
        scheduler.add(j)
    batch = scheduler.schedule(0, ledger)
    assert batch.jobs == tuple(jobs)
    ranks = {j.job_id: {owner_rank(s.span.content_hash, 2) for s in j.spans} for j in jobs}
    assert {0, 1} in ranks.values() and {0} in ranks.values(), "the seeds must give both kinds"
    died = UnavailableError("vision encoder rank 1: rank 0 (cpu, pid 7) exited with signal 9")
    outcome = scheduler.update_from_output(batch, [EncodeStepResult(0)], {1: died})
    outcomes = {j.job_id: o for j, o in outcome.finished}
    for job_id, job_ranks in ranks.items():
        if 1 in job_ranks:
            assert outcomes[job_id] is died
        else:
            assert [r.status for r in outcomes[job_id]] == [SpanStatus.WRITTEN] * 3


def test_a_rank_that_does_not_serve_is_planned_around() -> None:
    scheduler, ledger = EncodeScheduler(max_batch_images=16), CacheLedger(2)
    scheduler.add(job(0, 6))
    batch = scheduler.schedule(0, ledger, serving=(0,))
    assert {p.owner_rank for p in batch.plan.spans} == {0}
    assert list(rank_payloads(step_payload(batch.jobs, batch.plan, 0))) == [0]
