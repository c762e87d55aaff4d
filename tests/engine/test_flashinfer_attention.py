"""flashinfer backend against the torch reference backend on random paged batches (bf16, CUDA).

Both backends get pools with the same random contents and the same q/k/v; pages are
shuffled across requests. EXTEND batches carry cached prefixes; DECODE batches have
varied lengths. GQA groups of 7 (Qwen2.5-VL-7B: 28 / 4) and 2.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import AttentionBatch, ForwardMode, create_attention_backend
from services.engine.kv_cache import KVPool

pytestmark = pytest.mark.gpu

PAGE_SIZE, NUM_PAGES, NUM_LAYERS, HEAD_DIM = 16, 256, 2, 128


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")


def _pools(num_kv_heads: int) -> tuple[KVPool, KVPool]:
    pools = [
        KVPool(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, num_kv_heads, HEAD_DIM, torch.bfloat16, "cuda")
        for _ in "ab"
    ]
    pools[0].k_buffer.normal_()
    pools[0].v_buffer.normal_()
    pools[1].k_buffer.copy_(pools[0].k_buffer)
    pools[1].v_buffer.copy_(pools[0].v_buffer)
    return pools[0], pools[1]


def _batch(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int]) -> AttentionBatch:
    order = torch.randperm(NUM_PAGES).tolist()
    tables, slots, start = [], [], 0
    for prefix, extend in zip(prefix_lens, extend_lens, strict=True):
        num_pages = (
            -(-(prefix + extend) // PAGE_SIZE) + 1
        )  # one spare page, as a reservation may hold
        table = order[start : start + num_pages]
        start += num_pages
        tables.append(table)
        slots += [
            table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
            for p in range(prefix, prefix + extend)
        ]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    return AttentionBatch(mode, seq_lens, list(extend_lens), tables, PAGE_SIZE, torch.tensor(slots))


CASES = {
    "extend_with_prefixes": (ForwardMode.EXTEND, [0, 17, 33, 5, 160], [30, 1, 16, 64, 7]),
    "decode": (ForwardMode.DECODE, [0, 15, 16, 100, 511, 1], [1, 1, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(28, 4), (8, 4)])
def test_flashinfer_matches_torch_backend(case, num_q_heads, num_kv_heads):
    torch.manual_seed(num_q_heads)
    mode, prefix_lens, extend_lens = CASES[case]
    ref_pool, fi_pool = _pools(num_kv_heads)
    kwargs = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": HEAD_DIM}
    reference = create_attention_backend("torch", kv_pool=ref_pool, **kwargs)
    flashinfer = create_attention_backend("flashinfer", kv_pool=fi_pool, **kwargs)
    batch = _batch(mode, prefix_lens, extend_lens)
    reference.plan(batch)
    flashinfer.plan(batch)
    n = batch.num_tokens
    for layer in range(NUM_LAYERS):
        q = torch.randn(n, num_q_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, num_kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        expected = reference.forward(layer, q, k, v)
        got = flashinfer.forward(layer, q, k, v)
        assert got.shape == expected.shape and got.dtype == torch.bfloat16
        err = (got.float() - expected.float()).abs().max().item()
        print(f"{case} {num_q_heads}/{num_kv_heads} layer {layer}: max abs err {err:.4f}")
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(fi_pool.k_buffer, ref_pool.k_buffer) and torch.equal(
        fi_pool.v_buffer, ref_pool.v_buffer
    )
