"""FP8 KV pages (``--kv-cache-dtype fp8_e4m3``) over the copying KV backends: they move as
stored, byte for byte, and read back the same values at decode; a prefill pool whose pages
are held another way than decode's is refused before anything moves."""

from __future__ import annotations

import time

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine.kv_cache import KVPool, KVScales
from services.prefill.validation import prompt_destination
from services.transfer.base import pool_layout
from tests.transfer.test_inprocess import COPYING_BACKENDS, endpoints

LAYERS, PAGE_SIZE, HEADS, DIM = 3, 4, 2, 8
SCALES = KVScales(k=(0.5, 1.0, 0.02), v=(2.0, 0.125, 1.0))
SRC_PAGES, DST_PAGES = [2, 3, 4, 7, 0], [9, 10, 11, 1, 5]


def fp8_pool(num_pages: int, seed: int) -> KVPool:
    """A pool whose every page holds quantized K and V of random bf16 values."""
    pool = KVPool(LAYERS, num_pages, PAGE_SIZE, HEADS, DIM, torch.bfloat16, "cpu", scales=SCALES)
    generator = torch.Generator().manual_seed(seed)
    slots = torch.arange(pool.num_slots)
    for layer in range(LAYERS):
        k, v = torch.randn(2, pool.num_slots, HEADS, DIM, generator=generator).bfloat16()
        pool.write(layer, slots, 3 * k, 3 * v)
    return pool


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _page_slots(page: int) -> torch.Tensor:
    return torch.arange(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_fp8_pages_move_byte_exact_and_read_back_the_same(backend) -> None:
    receiver, sender = endpoints(backend)
    src_pool, dst_pool = fp8_pool(8, seed=1), fp8_pool(12, seed=2)
    receiver.register(dst_pool)  # shm: the pool moves into its /dev/shm segment
    before_k, before_v = _bytes(dst_pool.k_buffer).clone(), _bytes(dst_pool.v_buffer).clone()
    dst = receiver.destination("req-1", DST_PAGES)
    assert dst.layout.dtype == "float8_e4m3fn" and dst.layout.page_nbytes == PAGE_SIZE * HEADS * DIM

    result = sender.send("req-1", src_pool, SRC_PAGES, dst, deadline_mono=time.monotonic() + 10)

    assert result.num_bytes == 2 * LAYERS * len(SRC_PAGES) * PAGE_SIZE * HEADS * DIM  # 1 B each
    for src_page, dst_page in zip(SRC_PAGES, DST_PAGES, strict=True):
        for name in ("k_buffer", "v_buffer"):
            got = _bytes(getattr(dst_pool, name)[:, dst_page])
            assert torch.equal(got, _bytes(getattr(src_pool, name)[:, src_page]))
        for layer in range(LAYERS):  # decode reads what prefill wrote, scales and all
            src_k, src_v = src_pool.read(layer, _page_slots(src_page))
            dst_k, dst_v = dst_pool.read(layer, _page_slots(dst_page))
            assert torch.equal(dst_k, src_k) and torch.equal(dst_v, src_v)
    others = [page for page in range(12) if page not in DST_PAGES]
    assert torch.equal(_bytes(dst_pool.k_buffer)[:, others], before_k[:, others])
    assert torch.equal(_bytes(dst_pool.v_buffer)[:, others], before_v[:, others])
    receiver.close()


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_pools_of_different_kv_dtypes_are_refused_before_anything_moves(backend) -> None:
    receiver, sender = endpoints(backend)
    dst_pool = KVPool(LAYERS, 12, PAGE_SIZE, HEADS, DIM, torch.bfloat16, "cpu")
    receiver.register(dst_pool)
    before = dst_pool.k_buffer.clone()
    dst = receiver.destination("req-1", DST_PAGES)
    src_pool = fp8_pool(8, seed=1)
    mismatch = (
        r"KV layout mismatch for req-1: dtype is float8_e4m3fn here, bfloat16 at the destination "
        r"\(prefill and decode need the same --dtype and --kv-cache-dtype\)"
    )
    # prefill's admission check of the request's KvRef, before it computes anything
    with pytest.raises(InvalidRequestError, match=mismatch) as refused:
        prompt_destination(dst, pool_layout(src_pool), 5 * PAGE_SIZE, backend)
    assert refused.value.param == "kv_ref"
    with pytest.raises(InvalidRequestError, match=mismatch):
        sender.send("req-1", src_pool, SRC_PAGES, dst, deadline_mono=time.monotonic() + 10)
    assert torch.equal(dst_pool.k_buffer, before)
    receiver.close()
