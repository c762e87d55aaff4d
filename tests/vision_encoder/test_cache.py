"""EmbeddingCacheManager: LRU order, byte budget, the eviction log."""

from __future__ import annotations

import torch

from services.vision_encoder.cache import EmbeddingCacheManager


def rows(n: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((n, 4), value)  # n * 16 bytes


def test_lru_eviction_keeps_the_budget() -> None:
    cache = EmbeddingCacheManager(budget_bytes=3 * 64)
    for name in "abc":
        assert cache.insert(name, rows(4), (1, 4, 4))
    assert cache.num_bytes == 192 and cache.num_entries == 3
    assert cache.lookup_entry("a") is not None  # a is now the most recent; b is the oldest
    assert cache.insert("d", rows(4))
    assert not cache.contains("b") and all(cache.contains(x) for x in "acd")
    assert cache.insert("e", rows(8))  # needs two entries' room: c and a go
    assert [x for x in "abcde" if cache.contains(x)] == ["d", "e"]
    assert cache.num_bytes == 64 + 128 and cache.take_evicted() == ["b", "c", "a"]


def test_entries_keep_their_rows_and_grid() -> None:
    cache = EmbeddingCacheManager(budget_bytes=1024)
    assert cache.lookup_entry("x") is None and not cache.contains("x")
    cache.insert("x", rows(2, 1.5), (1, 2, 4))
    entry = cache.lookup_entry("x")
    assert entry is not None and entry.grid_thw == (1, 2, 4)
    assert torch.equal(entry.rows, rows(2, 1.5)) and cache.contains("x")


def test_contains_leaves_the_lru_order_alone() -> None:
    cache = EmbeddingCacheManager(budget_bytes=2 * 64)
    cache.insert("a", rows(4))
    cache.insert("b", rows(4))
    assert cache.contains("a")  # not a use: a stays the oldest
    cache.insert("c", rows(4))
    assert cache.take_evicted() == ["a"]


def test_an_entry_larger_than_the_budget_is_not_cached() -> None:
    cache = EmbeddingCacheManager(budget_bytes=100)
    cache.insert("small", rows(2))
    assert not cache.can_insert(128)
    assert not cache.insert("big", rows(8))
    assert cache.contains("small") and not cache.contains("big") and cache.num_bytes == 32


def test_views_are_copied_so_the_budget_counts_real_bytes() -> None:
    big = torch.zeros(100, 4)
    cache = EmbeddingCacheManager(budget_bytes=1024)
    cache.insert("v", big[10:12])
    entry = cache.lookup_entry("v")
    assert entry is not None
    stored = entry.rows
    assert stored.untyped_storage().nbytes() == 32
    big[10:12] = 7.0
    assert torch.equal(stored, torch.zeros(2, 4))


def test_reinserting_a_key_replaces_it() -> None:
    cache = EmbeddingCacheManager(budget_bytes=1024)
    cache.insert("k", rows(2, 1.0))
    cache.insert("k", rows(3, 2.0))
    assert cache.num_entries == 1 and cache.num_bytes == 48


def test_evictions_are_logged_until_taken_and_clear_logs_none() -> None:
    cache = EmbeddingCacheManager(budget_bytes=2 * 64)
    for name in "abc":
        cache.insert(name, rows(4))
    cache.insert("d", rows(8))  # needs the whole budget: b and c go
    assert cache.take_evicted() == ["a", "b", "c"]
    assert cache.take_evicted() == []
    cache.clear()  # behind the ledger's back: the rank reports it as missing hits instead
    assert cache.take_evicted() == [] and cache.num_entries == 0
