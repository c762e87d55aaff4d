"""The encoder on W = 1, 2, 3 rank processes (each a rank group of one): the same rows as one
rank, each distinct image encoded once by its owner, per-rank caches, a ledger the ranks
correct, a rank's failure, a killed rank that fails only its calls and costs the other
ranks none of their cache. One encoder per W serves the whole module."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import pytest
import torch

from services.common.errors import StageServeError, UnavailableError
from services.vision_encoder.plan import owner_rank
from tests.conftest import image_bytes
from tests.vision_encoder.conftest import (
    ServedEncoder,
    assert_rows_close,
    reference_rows,
    serve_encoder,
    span_input,
    spans_for,
    wait_until,
)
from tests.vision_encoder.rank_hooks import ClearCache, Delay, Fail

pytestmark = pytest.mark.slow
SIZES = [(64, 48), (90, 60), (40, 120), (150, 100), (56, 56), (200, 90)]


@pytest.fixture(scope="module")
def encoders():
    with serve_encoder(1) as one, serve_encoder(2) as two, serve_encoder(3) as three:
        yield {1: one, 2: two, 3: three}


def distinct_images(seed: int, sizes=SIZES) -> list[bytes]:
    return [image_bytes(w, h, seed=seed + i) for i, (w, h) in enumerate(sizes)]


def gained(now: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(now, before, strict=True)]


def owned_image(image_processor, rank: int, world_size: int, seed: int, size=(56, 56)) -> bytes:
    """The first image from ``seed`` on whose owner is ``rank``."""
    for k in range(200):
        data = image_bytes(*size, seed=seed + k)
        content_hash = span_input(image_processor, data, 0).span.content_hash
        if owner_rank(content_hash, world_size) == rank:
            return data
    raise AssertionError(f"no image of rank {rank} among 200 seeds")


def is_holding_one_call(enc: ServedEncoder) -> bool:
    """One call is in its step (held by a Delay) and nothing waits behind it."""
    leader = enc.app.leader
    return leader.num_pending == 1 and leader.scheduler.num_waiting == 0


@pytest.mark.parametrize("num_ranks", [2, 3])
async def test_rows_equal_one_ranks_for_repeated_and_distinct_images(
    encoders, image_processor, vision_model, num_ranks
) -> None:
    images = distinct_images(seed=10 * num_ranks)
    order = [0, 1, 0, 2, 3, 1, 4, 5, 3]  # repeats within the call, sizes mixed
    spans = spans_for(image_processor, [images[i] for i in order])
    num_rows = sum(s.span.length for s in spans)
    buffers = []
    for w in (1, num_ranks):
        enc = encoders[w]
        prefill = enc.prefill()
        encoded = enc.per_rank("images_encoded")
        results = await enc.encode(f"mix-{w}", spans, prefill.destination("mix", 0, num_rows))
        assert [r.is_cache_hit for r in results] == [i in order[:k] for k, i in enumerate(order)]
        assert [r.owner_rank for r in results] == [
            owner_rank(s.span.content_hash, w) for s in spans
        ]
        per_rank = gained(enc.per_rank("images_encoded"), encoded)
        owners = [owner_rank(s.span.content_hash, w) for s in spans_for(image_processor, images)]
        assert per_rank == [
            owners.count(r) for r in range(w)
        ]  # each distinct image once, by its owner
        buffers.append(prefill.buffer.rows(0, num_rows))
    assert_rows_close(buffers[0], buffers[1])
    expected = reference_rows(vision_model, image_processor, [images[i] for i in order])
    assert_rows_close(buffers[1], torch.cat(expected))


@pytest.mark.parametrize("num_ranks", [2, 3])
async def test_a_batch_of_calls_encodes_each_image_once_across_ranks(
    encoders, image_processor, vision_model, num_ranks
) -> None:
    enc = encoders[num_ranks]
    images = distinct_images(seed=100 * num_ranks)
    calls = [[0, 1], [2, 0], [3, 4, 5], [1, 5]]  # four calls sharing images, one batch
    prefill = enc.prefill()
    encoded, forwards = enc.per_rank("images_encoded"), enc.per_rank("vit_forwards")
    blocker = span_input(image_processor, image_bytes(56, 56, seed=7 * num_ranks + 1), 0)
    await enc.hook(Delay(rank=owner_rank(blocker.span.content_hash, num_ranks), seconds=2.0))
    held = asyncio.ensure_future(enc.encode("blocker", [blocker], prefill.destination("b", 0, 4)))
    await wait_until(lambda: is_holding_one_call(enc))
    starts, tasks = [], []
    for k, call in enumerate(calls):
        spans = spans_for(image_processor, [images[i] for i in call])
        start = 100 + 400 * k
        starts.append((start, spans))
        num_rows = sum(s.span.length for s in spans)
        tasks.append(
            enc.encode(f"call-{k}", spans, prefill.destination(f"call-{k}", start, num_rows))
        )
    results = await asyncio.gather(*tasks)
    await held
    owners = [
        owner_rank(s.span.content_hash, num_ranks) for s in spans_for(image_processor, images)
    ]
    per_rank = gained(enc.per_rank("images_encoded"), encoded)
    assert per_rank == [
        owners.count(r) + (r == owner_rank(blocker.span.content_hash, num_ranks))
        for r in range(num_ranks)
    ]
    assert all(n <= 2 for n in gained(enc.per_rank("vit_forwards"), forwards))  # blocker + batch
    hits = [r.is_cache_hit for call in results for r in call]
    assert hits.count(False) == len(images)  # the four calls ran as one batch
    reference = dict(enumerate(reference_rows(vision_model, image_processor, images)))
    for (start, spans), call in zip(starts, calls, strict=True):
        num_rows = sum(s.span.length for s in spans)
        assert_rows_close(
            prefill.buffer.rows(start, num_rows), torch.cat([reference[i] for i in call])
        )


async def test_a_cache_cleared_behind_the_leaders_back_is_encoded_again(
    encoders, image_processor, vision_model
) -> None:
    enc = encoders[2]
    images = distinct_images(seed=500, sizes=[(70, 98), (98, 70), (84, 84), (56, 112)])
    owners = [owner_rank(s.span.content_hash, 2) for s in spans_for(image_processor, images)]
    assert set(owners) == {0, 1}, "the seeds must give both ranks an image"
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    prefill = enc.prefill()
    await enc.encode("warm", spans, prefill.destination("warm", 0, num_rows))
    await enc.hook(ClearCache(rank=1))  # the leader still believes rank 1 holds its images
    misses, encoded = enc.per_rank("ledger_misses"), enc.per_rank("images_encoded")
    again = await enc.encode("again", spans, prefill.destination("again", 1000, num_rows))
    assert [r.is_cache_hit for r in again] == [
        o == 0 for o in owners
    ]  # rank 1's were encoded again
    assert gained(enc.per_rank("ledger_misses"), misses) == [0, owners.count(1)]
    assert gained(enc.per_rank("images_encoded"), encoded) == [0, owners.count(1)]
    expected = torch.cat(reference_rows(vision_model, image_processor, images))
    assert_rows_close(prefill.buffer.rows(1000, num_rows), expected)
    third = await enc.encode("third", spans, prefill.destination("third", 2000, num_rows))
    assert all(r.is_cache_hit for r in third)  # the ledger is right again


async def test_a_failing_rank_fails_its_step_alike_and_the_next_batch_runs(
    encoders, image_processor
) -> None:
    enc = encoders[2]
    prefill = enc.prefill()
    span = span_input(image_processor, owned_image(image_processor, 1, 2, seed=600), 0)
    await enc.hook(Fail(rank=1))
    with pytest.raises(
        StageServeError,
        match=r"vision encoder rank 1: step \d+ failed on rank 0: RuntimeError: injected failure "
        r"of rank 1",
    ):
        await enc.encode("fails", [span], prefill.destination("fails", 0, span.span.length))
    assert enc.health.is_serving and all(group.is_ready for group in enc.app.groups)
    results = await enc.encode("next", [span], prefill.destination("next", 0, span.span.length))
    assert not torch.isnan(prefill.buffer.rows(0, span.span.length)).any()
    assert len(results) == 1


async def test_cache_capacity_grows_with_the_ranks(image_processor) -> None:
    size = (84, 84)
    entry_bytes = span_input(image_processor, image_bytes(*size), 0).span.length * 64 * 4
    candidates = [image_bytes(*size, seed=700 + i) for i in range(40)]
    by_owner: dict[int, list[bytes]] = {0: [], 1: []}
    for data in candidates:
        by_owner[owner_rank(span_input(image_processor, data, 0).span.content_hash, 2)].append(data)
    images = by_owner[0][:3] + by_owner[1][:3]  # 6 entries: 3 per rank of W = 2
    hits = {}
    for num_ranks in (1, 2):
        with serve_encoder(num_ranks, cache_bytes=3 * entry_bytes) as enc:
            prefill = enc.prefill()
            for rounds in range(2):
                for k, data in enumerate(images):
                    span = span_input(image_processor, data, 0)
                    dst = prefill.destination("c", 0, span.span.length)
                    [result] = await enc.encode(f"c{rounds}-{k}", [span], dst)
                    hits[num_ranks, rounds, k] = result.is_cache_hit
            cached = [enc.value("cache_bytes", rank=str(r)) for r in range(num_ranks)]
            assert all(c <= 3 * entry_bytes for c in cached)
            assert sum(cached) == min(6, 3 * num_ranks) * entry_bytes
    assert [hits[1, 1, k] for k in range(6)] == [False] * 6  # LRU over 6 with room for 3: none left
    assert [hits[2, 1, k] for k in range(6)] == [True] * 6  # two ranks hold all six


async def test_a_killed_rank_fails_only_its_calls_and_the_others_keep_their_caches(
    encoders, image_processor, vision_model
) -> None:
    enc = encoders[3]
    leader = enc.app.leader
    prefill = enc.prefill()
    images = [
        owned_image(image_processor, r, 3, seed=800 + 50 * r, size=(56, 84)) for r in range(3)
    ]
    spans = spans_for(image_processor, images)  # image r: owned by rank r
    num_rows = sum(s.span.length for s in spans)
    await enc.encode("cached", spans, prefill.destination("cached", 0, num_rows))
    old_pid = enc.app.groups[2].rank_pids[0]
    blocker = span_input(image_processor, owned_image(image_processor, 0, 3, seed=950), 0)
    await enc.hook(Delay(rank=0, seconds=2.0))
    await enc.hook(Delay(rank=2, seconds=30.0))
    held = asyncio.ensure_future(enc.encode("b", [blocker], prefill.destination("b", 0, 4)))
    await wait_until(lambda: is_holding_one_call(enc))
    # one batch: "killed" has a span on rank 2, "spared" only spans on ranks 0 and 1
    other = span_input(image_processor, owned_image(image_processor, 2, 3, seed=960), 0)
    killed_spans = [spans[0], msgspec.structs.replace(other, dest_row=spans[0].span.length)]
    killed_rows = sum(s.span.length for s in killed_spans)
    dst = prefill.destination("killed", 1000, killed_rows)
    killed = asyncio.ensure_future(enc.encode("killed", killed_spans, dst))
    spared_spans = spans_for(image_processor, [images[1], images[0]])
    spared_rows = sum(s.span.length for s in spared_spans)
    dst = prefill.destination("spared", 2000, spared_rows)
    spared = asyncio.ensure_future(enc.encode("spared", spared_spans, dst))
    await held
    await wait_until(lambda: leader.num_pending == 2 and leader.scheduler.num_waiting == 0)
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(
        UnavailableError,
        match=r"vision encoder rank 2: rank 0 \(cpu, pid \d+\) exited with signal SIGKILL",
    ):
        await killed
    assert [r.is_cache_hit for r in await spared] == [True, True]  # in the batch, not failed
    assert enc.health.is_serving  # ranks 0 and 1 serve while rank 2 re-forms
    reference = reference_rows(vision_model, image_processor, images)
    assert_rows_close(
        prefill.buffer.rows(2000, spared_rows), torch.cat([reference[1], reference[0]])
    )
    await wait_until(lambda: enc.app.groups[2].is_ready, 300.0)  # re-formed alone, warmed up
    assert enc.app.groups[2].rank_pids[0] != old_pid
    assert enc.health.is_serving
    misses = enc.counter("ledger_misses")
    results = await enc.encode("after", spans, prefill.destination("after", 3000, num_rows))
    # ranks 0 and 1 kept their caches; rank 2 came back empty and the ledger knew it
    assert [r.is_cache_hit for r in results] == [True, True, False]
    assert enc.counter("ledger_misses") == misses
    assert_rows_close(prefill.buffer.rows(3000, num_rows), torch.cat(reference))
