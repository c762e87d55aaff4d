"""One rank's share of a step, driven in this process (no rank processes): owned spans only,
one ViT call, its manifest (held, evicted, missing), per-job errors."""

from __future__ import annotations

import hashlib
import os
import time

import msgspec
import pytest
import torch

from services.transfer.embeddings import EmbeddingBuffer
from services.transfer.embeddings_inprocess import (
    EmbeddingFabric,
    InProcessEmbeddingReceiver,
    InProcessEmbeddingSender,
)
from services.vision_encoder.cache import EmbeddingCacheManager
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.plan import CacheLedger, make_plan, owner_rank, step_payload
from services.vision_encoder.rank_messages import EncodeStepResult
from services.vision_encoder.worker import EncoderWorker
from tests.conftest import image_bytes
from tests.vision_encoder.conftest import (
    assert_rows_close,
    rank_threads,
    reference_rows,
    span_input,
    spans_for,
)


@pytest.fixture
def rig(vision_model, image_processor):
    fabric = EmbeddingFabric()
    receiver = InProcessEmbeddingReceiver(fabric)
    buffer = EmbeddingBuffer(2048, vision_model.config.vision.out_hidden_size, torch.float32)
    buffer.tensor.fill_(float("nan"))
    receiver.register(buffer)
    workers = [
        EncoderWorker(
            rank,
            vision_model,
            image_processor,
            EmbeddingCacheManager(1 << 20),
            InProcessEmbeddingSender(fabric),
            1 << 20,
        )
        for rank in range(2)
    ]
    yield workers, receiver, buffer
    receiver.close()


def run_step(workers, jobs: list[EncodeJob], ledger: CacheLedger) -> list[EncodeStepResult]:
    """One step of every rank over ``jobs``, planned from ``ledger``, which takes the manifests."""
    plan = make_plan([s.span.content_hash for job in jobs for s in job.spans], ledger)
    payload = step_payload(jobs, plan, time.monotonic())
    with rank_threads():
        results = [w.execute(payload, time.monotonic()) for w in workers]
    ledger.update_from_results(plan, results)
    return results


def test_each_rank_encodes_and_sends_only_the_images_it_owns(
    rig, vision_model, image_processor
) -> None:
    workers, receiver, buffer = rig
    images = [image_bytes(56 + 14 * i, 70, seed=40 + i) for i in range(6)]
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    job = EncodeJob(
        0, "r", tuple(spans), (receiver.destination("r", 0, num_rows),), time.monotonic() + 30
    )
    ledger = CacheLedger(2)
    results = run_step(workers, [job], ledger)
    owners = [owner_rank(s.span.content_hash, 2) for s in spans]
    assert [r.num_images_encoded for r in results] == [owners.count(0), owners.count(1)]
    assert [r.num_vit_forwards for r in results] == [int(0 in owners), int(1 in owners)]
    for rank, result in enumerate(results):
        mine = {s.span.content_hash for s, o in zip(spans, owners, strict=True) if o == rank}
        assert set(result.manifest.held) == mine and result.manifest.missing == ()
        assert result.errors == ()
    assert_rows_close(
        buffer.rows(0, num_rows), torch.cat(reference_rows(vision_model, image_processor, images))
    )
    again = run_step(workers, [job], ledger)
    assert [r.num_images_encoded for r in again] == [0, 0]  # every span a hit on its owner


def test_a_planned_hit_that_is_not_cached_is_reported_missing_and_sends_nothing(
    rig, image_processor
) -> None:
    workers, receiver, buffer = rig
    data = image_bytes(70, 70, seed=50)
    span = span_input(image_processor, data, 0)
    rank = owner_rank(span.span.content_hash, 2)
    ledger = CacheLedger(2)
    job = EncodeJob(
        0, "r", (span,), (receiver.destination("r", 0, span.span.length),), time.monotonic() + 30
    )
    run_step(workers, [job], ledger)
    assert ledger.holds(rank, span.span.content_hash)
    workers[rank].cache.clear()  # behind the ledger's back
    buffer.tensor.fill_(float("nan"))
    results = run_step(workers, [job], ledger)
    assert results[rank].manifest.missing == (span.span.content_hash,)
    assert results[rank].manifest.held == () and results[rank].num_images_encoded == 0
    assert torch.isnan(buffer.tensor).all()  # its job is planned again: nothing was sent


def test_a_bad_image_fails_its_jobs_only(rig, image_processor) -> None:
    workers, receiver, buffer = rig
    good = span_input(image_processor, image_bytes(56, 56, seed=60), 0)
    junk = b"not an image at all"
    bad = msgspec.structs.replace(
        good,
        image_data=junk,
        span=msgspec.structs.replace(good.span, content_hash=hashlib.sha256(junk).hexdigest()),
    )
    deadline_mono = time.monotonic() + 30
    jobs = [
        EncodeJob(0, "good", (good,), (receiver.destination("good", 0, 4),), deadline_mono),
        EncodeJob(
            1,
            "bad",
            (good, msgspec.structs.replace(bad, dest_row=4)),
            (receiver.destination("bad", 100, 8),),
            deadline_mono,
        ),
    ]
    results = run_step(workers, jobs, CacheLedger(2))
    errors = [e for r in results for e in r.errors]
    assert [(e.job_id, e.error.error_type, e.error.param) for e in errors] == [
        (1, "InvalidRequestError", "spans[1].image_data")
    ]
    assert not torch.isnan(buffer.rows(0, 4)).any()


def test_a_steps_one_jpeg_decodes_by_bands_of_rows(
    rig, vision_model, image_processor, monkeypatch
) -> None:
    """A step with one image gives it the rank's band decoder (``jpeg_rows``: every decode
    thread on its rows); its rows are the reference's."""
    import services.vision_encoder.worker as worker_module
    from services.engine.processing import jpeg_rows

    workers, receiver, buffer = rig
    if jpeg_rows.pil_libjpeg() is None or jpeg_rows.shutil.which("cc") is None:
        pytest.skip("no C compiler, or a PIL without its own libjpeg: no band decoder")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: one decode thread, no bands")
    assert workers[0]._bands is not None
    calls = []
    real = workers[0]._bands.decode

    def decode(data, width, height):
        pixels = real(data, width, height)
        calls.append((width, height, pixels is not None))
        return pixels

    monkeypatch.setattr(workers[0]._bands, "decode", decode)
    images = [image_bytes(300, 200, seed=91, fmt="JPEG")]
    spans = spans_for(image_processor, images)
    num_rows = spans[0].span.length
    job = EncodeJob(
        0, "one", tuple(spans), (receiver.destination("one", 0, num_rows),), time.monotonic() + 30
    )
    run_step(workers[:1], [job], CacheLedger(1))
    assert calls == [(300, 200, True)]
    assert worker_module.DECODE_THREADS >= workers[0]._bands.num_bands >= 2
    assert_rows_close(
        buffer.rows(0, num_rows), torch.cat(reference_rows(vision_model, image_processor, images))
    )


def test_a_steps_images_decode_on_the_decode_threads_in_order(
    rig, vision_model, image_processor, monkeypatch
) -> None:
    import threading

    import services.vision_encoder.worker as worker_module

    workers, receiver, buffer = rig
    threads = []
    real = worker_module.decode_pixels

    def decode_pixels(data, max_bytes, bands=None):
        assert bands is None  # several images: one thread each, no bands
        threads.append(threading.current_thread().name)
        return real(data, max_bytes)

    monkeypatch.setattr(worker_module, "decode_pixels", decode_pixels)
    images = [
        image_bytes(56 + 14 * i, 70 + 28 * (i % 2), seed=70 + i, fmt=("JPEG", "PNG")[i % 2])
        for i in range(5)
    ]
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    junk = b"\xff\xd8\xff not a jpeg"
    bad = msgspec.structs.replace(
        spans[0],
        image_data=junk,
        span=msgspec.structs.replace(spans[0].span, content_hash=hashlib.sha256(junk).hexdigest()),
    )
    deadline_mono = time.monotonic() + 30
    jobs = [
        EncodeJob(
            0, "good", tuple(spans), (receiver.destination("good", 0, num_rows),), deadline_mono
        ),
        EncodeJob(1, "bad", (bad,), (receiver.destination("bad", 1000, 8),), deadline_mono),
    ]
    (result,) = run_step(workers[:1], jobs, CacheLedger(1))  # one rank owns every image
    assert [(e.job_id, e.error.param) for e in result.errors] == [(1, "spans[0].image_data")]
    assert result.num_images_encoded == 5 and result.num_vit_forwards == 1
    assert len(threads) == 6 and all(name.startswith("decode-0") for name in threads)
    assert_rows_close(
        buffer.rows(0, num_rows), torch.cat(reference_rows(vision_model, image_processor, images))
    )
