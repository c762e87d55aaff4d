"""Owner-elected plans for W = 1, 2, 4 ranks, a stand-in for an owner that does not serve, the
leader's cache ledger, the step payload and each rank's share of it."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from services.common.clients.vision_encoder import EncodeSpanInput
from services.common.destinations import EmbeddingDestination
from services.common.types import ImageSpanRef
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.plan import (
    CacheLedger,
    make_plan,
    owner_rank,
    rank_payloads,
    serving_owner,
    step_payload,
)
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
    ledger.clear_rank(0)  # rank 0 re-formed: rank 1's entries stay
    actions = {s.content_hash: s.action for s in make_plan(hashes, ledger).spans}
    assert all(
        (actions[x] is SpanAction.LOCAL_HIT) == (owner_rank(x, 2) == 1 and x != evicted)
        for x in hashes
    )
    ledger.clear_rank(1)
    assert all(s.action is SpanAction.OWNER_ENCODE for s in make_plan(hashes, ledger).spans)


def test_the_next_serving_rank_stands_in_for_an_owner_that_does_not_serve() -> None:
    hashes = [h(i) for i in range(40)]
    by_owner = {r: [x for x in hashes if owner_rank(x, 4) == r] for r in range(4)}
    assert all(by_owner.values())
    assert [serving_owner(x, 4, {0, 1, 2, 3}) for x in hashes] == [owner_rank(x, 4) for x in hashes]
    assert {serving_owner(x, 4, {0, 1, 3}) for x in by_owner[2]} == {3}
    assert {serving_owner(x, 4, {0, 1}) for x in by_owner[2] + by_owner[3]} == {0}  # wraps
    assert {serving_owner(x, 4, ()) for x in by_owner[3]} == {3}  # none serves: the owner's
    ledger = ledger_holding(4, set(hashes))
    plan = make_plan(hashes, ledger, serving={0, 1, 3})
    for x, span in zip(hashes, plan.spans, strict=True):
        standing_in = owner_rank(x, 4) == 2
        assert span.owner_rank == (3 if standing_in else owner_rank(x, 4))
        assert span.action is (SpanAction.OWNER_ENCODE if standing_in else SpanAction.LOCAL_HIT)


def span(data: bytes, dest_row: int) -> EncodeSpanInput:
    return EncodeSpanInput(
        ImageSpanRef(0, 6, hashlib.sha256(data).hexdigest(), (1, 4, 6)), data, dest_row
    )


def test_the_payload_carries_bytes_only_for_encodes() -> None:
    cached, fresh = b"cached image", b"fresh image"
    job = EncodeJob(
        3, "req", (span(cached, 0), span(fresh, 6), span(fresh, 12)), (DST,), deadline_mono=110.0
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


def test_each_rank_gets_the_jobs_and_bytes_of_its_own_spans_only() -> None:
    datas = [f"image-{i}".encode() for i in range(12)]
    hashes = [hashlib.sha256(d).hexdigest() for d in datas]
    owners = [owner_rank(x, 2) for x in hashes]
    assert set(owners) == {0, 1}
    only_0 = next(i for i, o in enumerate(owners) if o == 0)
    mixed = EncodeJob(1, "mixed", tuple(span(d, 6 * i) for i, d in enumerate(datas)), (DST,), 110.0)
    solo = EncodeJob(2, "solo", (span(datas[only_0], 0),), (DST,), 110.0)
    cached = {hashes[i] for i, o in enumerate(owners) if o == 1}  # rank 1 holds all of its own
    ledger = ledger_holding(2, cached)
    plan = make_plan([s.span.content_hash for j in (mixed, solo) for s in j.spans], ledger)
    payload = step_payload([mixed, solo], plan, now=100.0)
    shares = rank_payloads(payload)
    assert list(shares) == [0, 1]
    assert [j.job_id for j in shares[0].jobs] == [1, 2] and [j.job_id for j in shares[1].jobs] == [
        1
    ]
    for rank, share in shares.items():
        for rank_job, whole in zip(share.jobs, payload.jobs, strict=False):
            assert rank_job.destinations == whole.destinations
            assert rank_job.timeout_s == whole.timeout_s
            assert [s for s in whole.spans if s.owner_rank == rank] == list(rank_job.spans)
    assert shares[0].images == {hashes[i]: datas[i] for i, o in enumerate(owners) if o == 0}
    assert shares[1].images == {}  # its spans are all cache hits
    assert rank_payloads(
        step_payload([solo], make_plan([hashes[only_0]], ledger), 100.0)
    ).keys() == {0}
