"""The KV pool's size: the arithmetic on fake device totals, the start-up line, and a runner
that sizes itself off CUDA."""

from __future__ import annotations

import argparse

import pytest

from services.engine.gpu_defaults import memory_fraction
from services.engine.kv_sizing import (
    CPU_NUM_PAGES,
    KVPoolSize,
    kv_page_bytes,
    pages_for_memory,
)
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner

GIB = 1 << 30
PAGE_7B = kv_page_bytes(28, 16, 4, 128, 2)  # Qwen2.5-VL-7B, bf16, 16-token pages


def test_a_page_holds_k_and_v_of_every_layer() -> None:
    assert PAGE_7B == 2 * 28 * 16 * 4 * 128 * 2 == 917504
    assert kv_page_bytes(2, 8, 1, 16, 4) == 2 * 2 * 8 * 16 * 4


@pytest.mark.parametrize(
    ("total", "utilization", "used", "expected"),
    [
        (80 * GIB, 0.85, 17 * GIB, (int(80 * GIB * 0.85) - 17 * GIB) // PAGE_7B),
        (80 * GIB, 0.5, 0, int(40 * GIB) // PAGE_7B),
        (141 * GIB, 1.0, 141 * GIB - PAGE_7B, 1),  # exactly one page left
    ],
)
def test_the_pool_takes_the_share_left_after_what_is_used(total, utilization, used, expected):
    pages = pages_for_memory(total, utilization, used, PAGE_7B)
    assert pages == expected
    assert used + pages * PAGE_7B <= total * utilization < used + (pages + 1) * PAGE_7B


def test_a_share_that_leaves_no_page_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"0.2 of the 85.9 GB device is 17.2 GB.*take 21.5 GB"):
        pages_for_memory(80 * GIB, 0.2, 20 * GIB, PAGE_7B)


def test_the_start_line_says_pages_tokens_gb_and_where_they_came_from() -> None:
    sized = KVPoolSize(1000, 16, PAGE_7B, 0.85, 80 * GIB, 17 * GIB)
    line = sized.describe()
    assert "1000 pages, 16000 tokens, 0.92 GB" in line
    assert "--gpu-memory-utilization 0.85 of 85.9 GB, less 18.25 GB" in line
    assert KVPoolSize(8, 16, PAGE_7B).describe().endswith("(--num-pages)")


@pytest.mark.parametrize("text", ["0", "-0.1", "1.01", "nan"])
def test_a_memory_fraction_is_in_zero_to_one(text) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must be in \\(0, 1\\]"):
        memory_fraction(text)
    assert memory_fraction("1") == 1.0 and memory_fraction("0.75") == 0.75


def test_a_runner_off_cuda_takes_the_cpu_count_or_the_one_given(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir, device="cpu", components=("language",))
    sized = ModelRunner(model, KVCacheConfig(None, 16), cuda_graph_batch_sizes=())
    assert sized.page_manager.num_pages == sized.kv_pool.num_pages == CPU_NUM_PAGES
    assert sized.pool_size.source == "CPU default"
    given = ModelRunner(model, KVCacheConfig(7, 16), cuda_graph_batch_sizes=())
    assert given.kv_pool.num_pages == given.pool_size.num_pages == 7
    assert given.pool_size.page_bytes == 2 * given.kv_pool.num_layers * given.kv_pool.page_nbytes
