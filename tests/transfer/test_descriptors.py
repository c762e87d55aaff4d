import msgspec
import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine.kv_cache import KVPool
from services.transfer.base import (
    KvDestination,
    KvPoolLayout,
    TransferPlan,
    page_runs,
    plan_transfer,
    pool_layout,
)

PAGE_NBYTES = 64


def layout(k_base: int, v_base: int, num_pages: int, num_layers: int = 2) -> KvPoolLayout:
    # page_size 2 x 4 heads x 4 dim x fp16 = 64 bytes
    return KvPoolLayout(k_base, v_base, num_layers, num_pages, 2, 4, 4, "float16", PAGE_NBYTES)


def destination(dst_layout: KvPoolLayout, page_ids: tuple[int, ...]) -> KvDestination:
    return KvDestination("inprocess", "peer:1", "req-1", dst_layout, page_ids)


def test_kv_destination_msgpack_and_json_round_trip() -> None:
    dst = destination(layout(1 << 40, (1 << 40) + 4096, num_pages=8), (3, 4, 7))
    for encode, decode in (
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
        (msgspec.json.encode, msgspec.json.decode),
    ):
        decoded = decode(encode(dst), type=KvDestination)
        assert decoded == dst
        assert isinstance(decoded.page_ids, tuple) and isinstance(decoded.layout, KvPoolLayout)


def test_page_runs_coalesce_where_both_sides_are_adjacent() -> None:
    assert page_runs([], []) == []
    assert page_runs([3, 4, 5], [7, 8, 9]) == [(3, 7, 3)]
    # src adjacent but dst not, dst adjacent but src not, then a fresh run
    assert page_runs([1, 2, 6, 9, 10], [5, 9, 10, 11, 12]) == [
        (1, 5, 1),
        (2, 9, 1),
        (6, 10, 1),
        (9, 11, 2),
    ]
    assert page_runs([4, 3], [0, 1]) == [(4, 0, 1), (3, 1, 1)]  # descending source never merges


def test_plan_exact_offsets_for_every_layer_k_and_v() -> None:
    src = layout(k_base=10_000, v_base=50_000, num_pages=6)
    dst = destination(layout(k_base=200_000, v_base=300_000, num_pages=10), (7, 8, 2))
    plan = plan_transfer(src, [0, 1, 4], dst)
    expected = []
    for src_base, dst_base in ((10_000, 200_000), (50_000, 300_000)):
        for layer in range(2):
            # run (0 -> 7, 2 pages) then (4 -> 2, 1 page)
            expected.append(
                (src_base + (layer * 6 + 0) * 64, dst_base + (layer * 10 + 7) * 64, 128)
            )
            expected.append((src_base + (layer * 6 + 4) * 64, dst_base + (layer * 10 + 2) * 64, 64))
    assert list(zip(plan.src_addrs, plan.dst_addrs, plan.lengths, strict=True)) == expected
    assert plan.num_descriptors == 8 and plan.num_bytes == 2 * 2 * 3 * 64


def test_whole_pool_to_whole_pool_is_one_descriptor_per_buffer() -> None:
    # every page of every layer in order: layers are adjacent in memory, so K and V are one run each
    src = layout(k_base=0, v_base=10_000, num_pages=4, num_layers=3)
    dst = destination(layout(k_base=20_000, v_base=30_000, num_pages=4, num_layers=3), (0, 1, 2, 3))
    plan = plan_transfer(src, [0, 1, 2, 3], dst)
    assert plan == TransferPlan((0, 10_000), (20_000, 30_000), (3 * 4 * 64, 3 * 4 * 64))


def test_empty_request_plans_nothing() -> None:
    plan = plan_transfer(layout(0, 1000, 4), [], destination(layout(5000, 6000, 4), ()))
    assert plan == TransferPlan((), (), ()) and plan.num_bytes == 0


@pytest.mark.parametrize(
    ("src_pages", "dst_layout", "dst_pages", "match"),
    [
        ([0, 1], layout(0, 0, 8), (1,), "source pages"),
        ([0], layout(0, 0, 8, num_layers=3), (1,), "num_layers"),
        ([0, 1], layout(0, 0, 8), (1, 1), "duplicate"),
        ([0], layout(0, 0, 8), (8,), "outside"),
        ([9], layout(0, 0, 8), (1,), "outside"),
    ],
)
def test_incompatible_destinations_are_rejected(src_pages, dst_layout, dst_pages, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        plan_transfer(layout(0, 0, 8), src_pages, destination(dst_layout, dst_pages))


def test_pool_layout_matches_the_pool_tensors() -> None:
    pool = KVPool(
        num_layers=2,
        num_pages=5,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        device="cpu",
    )
    got = pool_layout(pool)
    assert got.k_base == pool.k_buffer.data_ptr() and got.v_base == pool.v_buffer.data_ptr()
    assert got.page_nbytes == 4 * 2 * 8 * 2 and got.dtype == "bfloat16"
    # the byte offset of (layer 1, page 3) agrees with torch's own address of that page
    assert pool.k_buffer[1, 3].data_ptr() == got.k_base + (1 * 5 + 3) * got.page_nbytes
