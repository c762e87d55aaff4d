import pytest
import torch

from services.common.errors import CapacityError
from services.engine.kv_cache import KVPageManager, KVPool, RequestPageTable


def test_allocate_and_free_accounting() -> None:
    manager = KVPageManager(num_pages=8, page_size=4)
    assert manager.num_free_pages == 8
    first = manager.allocate(3)
    assert first == [0, 1, 2]
    second = manager.allocate(2)
    assert second == [3, 4]
    assert manager.num_free_pages == 3
    assert manager.can_allocate(3) and not manager.can_allocate(4)
    manager.free(first)
    assert manager.num_free_pages == 6
    assert manager.allocate(2) == [0, 1]  # lowest ids first after a free
    assert manager.allocate(0) == []


def test_capacity_error_leaves_state_unchanged() -> None:
    manager = KVPageManager(num_pages=4, page_size=2)
    held = manager.allocate(3)
    with pytest.raises(CapacityError):
        manager.allocate(2)
    assert manager.num_free_pages == 1
    manager.free(held)
    assert manager.num_free_pages == 4


def test_double_free_and_unknown_page_assert() -> None:
    manager = KVPageManager(num_pages=4, page_size=2)
    pages = manager.allocate(2)
    manager.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        manager.free([pages[0]])
    with pytest.raises(AssertionError, match="unknown"):
        manager.free([17])
    with pytest.raises(AssertionError, match="double free"):
        manager.free([2])  # never allocated
    assert manager.num_free_pages == 4


def test_reserve_grows_incrementally() -> None:
    manager = KVPageManager(num_pages=6, page_size=4)
    table = RequestPageTable(manager)
    assert "a" not in table
    assert table.reserve("a", 5) == [0, 1]
    assert "a" in table
    assert table.reserve("a", 8) == []  # already covered
    assert table.reserve("a", 9) == [2]
    assert table.pages("a") == [0, 1, 2]
    table.reserve("b", 4)
    assert table.pages("b") == [3]
    assert manager.num_free_pages == 2


def test_reserve_short_raises_without_leak() -> None:
    manager = KVPageManager(num_pages=4, page_size=4)
    table = RequestPageTable(manager)
    table.reserve("a", 8)
    assert not table.can_reserve("a", 17)
    with pytest.raises(CapacityError):
        table.reserve("a", 17)
    assert table.pages("a") == [0, 1]
    assert manager.num_free_pages == 2
    with pytest.raises(CapacityError):
        table.reserve("b", 100)
    assert manager.num_free_pages == 2
    assert table.can_reserve("a", 16)


def test_slots_mapping() -> None:
    manager = KVPageManager(num_pages=8, page_size=4)
    table = RequestPageTable(manager)
    manager.allocate(2)  # pages 0, 1 held elsewhere
    table.reserve("x", 4)  # page 2
    manager.allocate(1)  # page 3
    table.reserve("x", 10)  # pages 4, 5
    assert table.pages("x") == [2, 4, 5]
    slots = table.slots("x", 2, 10)
    assert slots.dtype == torch.long
    assert slots.tolist() == [10, 11, 16, 17, 18, 19, 20, 21]
    assert table.slots("x", 3, 3).tolist() == []
    with pytest.raises(AssertionError):
        table.slots("x", 0, 13)


def test_release_frees_all_pages() -> None:
    manager = KVPageManager(num_pages=4, page_size=2)
    table = RequestPageTable(manager)
    table.reserve("a", 5)
    assert manager.num_free_pages == 1
    table.release("a")
    assert "a" not in table
    assert manager.num_free_pages == 4
    table.release("a")  # idempotent
    assert manager.num_free_pages == 4


def test_detach_hands_pages_over_still_allocated() -> None:
    manager = KVPageManager(num_pages=4, page_size=2)
    table = RequestPageTable(manager)
    table.reserve("a", 5)
    pages = table.detach("a")
    assert pages == [0, 1, 2] and "a" not in table
    assert manager.num_free_pages == 1  # the caller owns them now
    assert table.detach("a") == []
    manager.free(pages)
    assert manager.num_free_pages == 4


def test_pool_layout_and_write() -> None:
    pool = KVPool(
        num_layers=3,
        num_pages=5,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )
    assert pool.k_buffer.shape == (3, 5, 4, 2, 8) and pool.k_buffer.is_contiguous()
    assert pool.k_cache[1].shape == (5, 4, 2, 8)
    assert pool.k_cache[1].data_ptr() == pool.k_buffer[1].data_ptr()  # views, one region
    regions = pool.memory_regions()
    assert regions[0] == (pool.k_buffer.data_ptr(), 3 * 5 * 4 * 2 * 8 * 4)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([6, 0, 19])  # page 1 offset 2, page 0 offset 0, page 4 offset 3
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k_cache[1][1, 2], k[0])
    assert torch.equal(pool.k_cache[1][0, 0], k[1])
    assert torch.equal(pool.v_cache[1][4, 3], v[2])
    assert pool.k_cache[0].abs().sum() == 0 and pool.k_cache[2].abs().sum() == 0
