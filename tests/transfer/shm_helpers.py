"""Pools, rows and byte-exact checks shared by the shm backend tests (test_shm*.py)."""

from __future__ import annotations

import os

import torch

from services.engine.kv_cache import KVPool
from services.transfer.embeddings import EmbeddingBuffer
from services.transfer.shm_memory import SHM_DIR, decode_session_id

SRC_PAGES = [0, 1, 2, 3, 10, 20, 21, 5]  # runs: 0..3 -> 40..43, 10 -> 7, 20..21 -> 30..31, 5 -> 3


DST_PAGES = [40, 41, 42, 43, 7, 30, 31, 3]


ROW_RUNS = [(0, 3, 5), (5, 8, 2), (7, 20, 4)]  # the first two coalesce


HIDDEN = 48


BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


WAIT_S = 60  # a hang fails the test instead of blocking it


def fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` overwritten with arbitrary bit patterns (NaNs included), compared as integers."""
    bits = t.view(BITS[t.dtype])
    info = torch.iinfo(bits.dtype)
    generator = torch.Generator().manual_seed(seed)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype, generator=generator))
    return t


def make_pool(num_pages: int, dtype: torch.dtype, seed: int) -> KVPool:
    pool = KVPool(4, num_pages, 4, 2, 8, dtype, "cpu")  # [L=4, P, S=4, Hkv=2, D=8]
    fill(pool.k_buffer, seed)
    fill(pool.v_buffer, seed + 1)
    return pool


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def segment_path(session_id: str) -> str:
    return os.path.join(SHM_DIR, decode_session_id(session_id).name)


def pages_landed(dst: KVPool, before: tuple[torch.Tensor, torch.Tensor], src: KVPool) -> bool:
    """Every source page of every layer in its destination page; every other page unchanged."""
    landed = all(
        same(dst.k_buffer[:, d], src.k_buffer[:, s])
        and same(dst.v_buffer[:, d], src.v_buffer[:, s])
        for s, d in zip(SRC_PAGES, DST_PAGES, strict=True)
    )
    others = [p for p in range(dst.num_pages) if p not in DST_PAGES]
    return (
        landed
        and same(dst.k_buffer[:, others], before[0][:, others])
        and same(dst.v_buffer[:, others], before[1][:, others])
    )


def source_rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return fill(torch.empty(11, HIDDEN, dtype=dtype), seed)  # [11, HIDDEN]


def rows_landed(
    buffer: EmbeddingBuffer, start: int, before: torch.Tensor, rows: torch.Tensor
) -> bool:
    got = buffer.tensor
    landed = all(same(got[start + d : start + d + n], rows[s : s + n]) for s, d, n in ROW_RUNS)
    written = {start + d + i for _, d, n in ROW_RUNS for i in range(n)}
    others = [r for r in range(buffer.num_rows) if r not in written]
    return landed and same(buffer.tensor[others], before[others])
