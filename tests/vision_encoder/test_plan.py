"""Owner-elected plans for W = 1, 2, 4 ranks, the leader's cache ledger, and the step payload."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from services.common.clients.vision_encoder import EncodeSpanInput
from services.common.destinations import EmbeddingDestination
from services.common.types import ImageSpanRef
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.plan import CacheLedger, make_plan, owner_rank, step_payload
from services.vision_encoder.rank_messages import (
    EncodeStepPayload,
    EncodeStepResult,
    RankManifest,
    SpanAction,
)

DST = EmbeddingDestination("shm", "", "s", 0, 4096, 100, 256, 64, "float32")


def h(i: int) -> str:
    return hashlib.sha256(f"image-{i}".encode()).hexdigest()


def ledger_holding(world_size: int, cached: set[str]) -> CacheLedger:
    """A ledger told by every owner that it holds its images of ``cached``."""
    ledger = CacheLedger(world_size)
    plan = make_plan(sorted(cached), ledger)
    results = [
        EncodeStepResult(rank, manifest=RankManifest(tuple(plan.owned_hashes(rank)), (), ()))
        for rank in range(world_size)
    ]
    assert ledger.update_from_results(plan, results) == 0
    return ledger


def test_owner_is_the_first_64_bits_modulo_w() -> None:
    x = "00000000000000ff" + "e" * 48
    assert [owner_rank(x, w) for w in (1, 2, 4, 7)] == [0, 1, 3, 255 % 7]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plan_assigns_owners_and_actions_from_the_ledger(world_size: int) -> None:
    hashes = [h(i) for i in range(12)] + [h(3), h(0)]  # repeats within the batch
    cached = {h(i) for i in range(0, 12, 3)}
    plan = make_plan(hashes, ledger_holding(world_size, cached))
    assert len(plan.spans) == len(hashes)
    for span, x in zip(plan.spans, hashes, strict=True):
        assert span.content_hash == x and span.owner_rank == int(x[:16], 16) % world_size
        assert span.action is (SpanAction.LOCAL_HIT if x in cached else SpanAction.OWNER_ENCODE)
    encodes = {s.content_hash for s in plan.spans if s.action is SpanAction.OWNER_ENCODE}
    assert encodes == {x for x in hashes if x not in cached}
    if world_size > 1:
        assert len({s.owner_rank for s in plan.spans}) > 1  # 14 spans spread over the ranks


def test_the_ledger_takes_each_ranks_manifest() -> None:
    world_size = 2
    hashes = [h(i) for i in range(16)]  # both ranks own some
    ledger = ledger_holding(world_size, set(hashes))
    plan = make_plan(hashes, ledger)
    assert all(s.action is SpanAction.LOCAL_HIT for s in plan.spans)
    owned = [sorted(plan.owned_hashes(r)) for r in range(world_size)]
    gone, evicted = owned[0][0], owned[1][0]  # rank 0 lost one behind our back; rank 1 evicted one
    stranger = next(x for x in (h(i) for i in range(100, 200)) if owner_rank(x, world_size) == 1)
    results = [
        EncodeStepResult(0, manifest=RankManifest(tuple(owned[0][1:]), (), (gone,))),
        EncodeStepResult(1, manifest=RankManifest(tuple(owned[1][1:]), (evicted, stranger), ())),
    ]
    assert ledger.update_from_results(plan, results) == 1  # one planned hit was missing
    assert not ledger.holds(0, gone) and not ledger.holds(1, evicted)
    replan = make_plan(hashes, ledger)
    actions = {s.content_hash: s.action for s in replan.spans}
    assert actions[gone] is actions[evicted] is SpanAction.OWNER_ENCODE  # encoded again
    assert sum(a is SpanAction.LOCAL_HIT for a in actions.values()) == len(hashes) - 2
    ledger.clear()
    assert all(s.action is SpanAction.OWNER_ENCODE for s in make_plan(hashes, ledger).spans)


def span(data: bytes, dest_row: int) -> EncodeSpanInput:
    return EncodeSpanInput(
        ImageSpanRef(0, 6, hashlib.sha256(data).hexdigest(), (1, 4, 6)), data, dest_row
    )


def test_the_payload_carries_bytes_only_for_encodes() -> None:
    cached, fresh = b"cached image", b"fresh image"
    job = EncodeJob(
        3, "req", (span(cached, 0), span(fresh, 6), span(fresh, 12)), (DST,), deadline=110.0
    )
    ledger = ledger_holding(2, {hashlib.sha256(cached).hexdigest()})
    hashes = [s.span.content_hash for s in job.spans]
    payload = step_payload([job], make_plan(hashes, ledger), now=100.0)
    assert payload.images == {hashlib.sha256(fresh).hexdigest(): fresh}
    [rank_job] = payload.jobs
    assert (rank_job.job_id, rank_job.request_id, rank_job.timeout_s) == (3, "req", 10.0)
    assert [(s.index, s.dest_row, s.action) for s in rank_job.spans] == [
        (0, 0, SpanAction.LOCAL_HIT),
        (1, 6, SpanAction.OWNER_ENCODE),
        (2, 12, SpanAction.OWNER_ENCODE),
    ]
    assert rank_job.destinations == (DST,)
    wire = msgspec.msgpack.encode(payload)
    assert msgspec.msgpack.decode(wire, type=EncodeStepPayload) == payload
