"""CPU checks of the flashinfer backend's host side: CSR metadata and the missing-library error."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.engine.attention import AttentionBatch, ForwardMode, create_attention_backend
from services.engine.attention.flashinfer_backend import paged_kv_metadata
from services.engine.kv_cache import KVPool


def test_metadata_of_ragged_extend_batch():
    batch = AttentionBatch(
        mode=ForwardMode.EXTEND,
        seq_lens=[5, 4, 9],
        extend_lens=[5, 1, 3],
        page_tables=[[7, 2], [3, 8, 9], [0, 1, 4]],  # request 1 holds a spare page
        page_size=4,
        out_slots=torch.zeros(9, dtype=torch.long),
    )
    meta = paged_kv_metadata(batch)
    assert meta.qo_indptr.tolist() == [0, 5, 6, 9]
    assert meta.kv_indptr.tolist() == [0, 2, 3, 6]
    assert meta.kv_indices.tolist() == [7, 2, 3, 0, 1, 4]
    assert meta.kv_last_page_len.tolist() == [1, 4, 1]
    assert {
        t.dtype for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
    } == {torch.int32}


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed"
)
def test_missing_flashinfer_names_the_gpu_extra():
    pool = KVPool(1, 4, 4, 1, 64, torch.float32, "cpu")
    with pytest.raises(ImportError, match="gpu"):
        create_attention_backend(
            "flashinfer", kv_pool=pool, num_q_heads=2, num_kv_heads=1, head_dim=64
        )
