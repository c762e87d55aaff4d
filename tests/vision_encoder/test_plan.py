"""Owner-elected encoding plans for W = 1, 2, 4 ranks."""

from __future__ import annotations

import hashlib

import pytest

from services.vision_encoder.plan import EncodePlan, Manifest, PlanError, SpanAction, make_plan, owner_rank


def h(i: int) -> str:
    return hashlib.sha256(f"image-{i}".encode()).hexdigest()


def manifests(hashes: list[str], world_size: int, cached: set[str]) -> list[Manifest]:
    """Each rank holds the cached hashes it owns."""
    return [
        Manifest(rank, tuple(hashes), tuple(x in cached and owner_rank(x, world_size) == rank for x in hashes))
        for rank in range(world_size)
    ]


def test_owner_is_the_first_64_bits_modulo_w() -> None:
    x = "00000000000000ff" + "e" * 48
    assert [owner_rank(x, w) for w in (1, 2, 4, 7)] == [0, 1, 3, 255 % 7]
    assert owner_rank(x, 4) == owner_rank(x, 4)  # deterministic


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plan_assigns_owners_and_actions(world_size: int) -> None:
    hashes = [h(i) for i in range(12)] + [h(3), h(0)]  # repeats within the batch
    cached = {h(i) for i in range(0, 12, 3)}
    plan = make_plan(hashes, manifests(hashes, world_size, cached), world_size)
    assert isinstance(plan, EncodePlan) and len(plan.spans) == len(hashes)
    for span, x in zip(plan.spans, hashes, strict=True):
        assert span.content_hash == x and span.owner_rank == int(x[:16], 16) % world_size
        assert span.action is (SpanAction.LOCAL_HIT if x in cached else SpanAction.OWNER_ENCODE)
    encoded = [x for rank in range(world_size) for x in plan.encode_hashes(rank)]
    assert sorted(encoded) == sorted({x for x in hashes if x not in cached})  # each distinct miss once
    assert len(encoded) == len(set(encoded))
    hits = [x for rank in range(world_size) for x in plan.hit_hashes(rank)]
    assert sorted(hits) == sorted(cached)
    if world_size > 1:
        assert len({s.owner_rank for s in plan.spans}) > 1  # 14 spans spread over the ranks


def test_encode_hashes_keep_first_appearance_order() -> None:
    hashes = [h(5), h(1), h(5), h(2)]
    plan = make_plan(hashes, manifests(hashes, 1, set()), 1)
    assert plan.encode_hashes(0) == [h(5), h(1), h(2)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_disagreeing_manifests_are_a_plan_error(world_size: int) -> None:
    hashes = [h(i) for i in range(12)]
    good = manifests(hashes, world_size, set())
    with pytest.raises(PlanError, match="one manifest per rank"):
        make_plan(hashes, good[:-1], world_size)
    with pytest.raises(PlanError, match="one manifest per rank"):
        make_plan(hashes, [*good[:-1], good[0]], world_size)
    other_batch = [*good[:-1], Manifest(world_size - 1, tuple(reversed(hashes)), good[-1].is_cached)]
    with pytest.raises(PlanError, match="different batch"):
        make_plan(hashes, other_batch, world_size)
    short = [*good[:-1], Manifest(world_size - 1, tuple(hashes), (False,))]
    with pytest.raises(PlanError, match="different batch"):
        make_plan(hashes, short, world_size)
    stray = next(x for x in hashes if owner_rank(x, world_size) != 0)
    rank0 = Manifest(0, tuple(hashes), tuple(x == stray for x in hashes))
    with pytest.raises(PlanError, match="diverged"):
        make_plan(hashes, [rank0, *good[1:]], world_size)
