import pytest
import torch

from services.engine.attention import (
    AttentionBatch,
    ForwardMode,
    create_attention_backend,
    supported_attention_backends,
)
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.kv_cache import KVPool

NUM_LAYERS = 2
NUM_Q_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
PAGE_SIZE = 4
NUM_PAGES = 40
NUM_DECODE_STEPS = 3
PREFIX_LENS = [5, 0, 9, 3]
EXTEND_LENS = [8, 7, 13, 1]


def dense_causal_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [T, Hq, D] float64
    num_q_per_kv = q.shape[1] // k.shape[1]
    kv_head = torch.arange(q.shape[1]) // num_q_per_kv  # q head h uses kv head h // group
    q64, k64, v64 = q.double(), k.double()[:, kv_head], v.double()[:, kv_head]  # [T, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * scale  # [Hq, T, T]
    seq_len = q.shape[0]
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v64)


def page_tables_for(max_lens: list[int], shuffled: bool) -> list[list[int]]:
    num_pages = [-(-n // PAGE_SIZE) for n in max_lens]
    order = torch.randperm(NUM_PAGES).tolist() if shuffled else list(range(NUM_PAGES))
    assert sum(num_pages) <= NUM_PAGES
    tables, start = [], 0
    for n in num_pages:
        tables.append(order[start : start + n])
        start += n
    return tables


def slots_of(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(start, end)]


def run_paged_vs_dense(dtype: torch.dtype, shuffled: bool, atol: float) -> None:
    torch.manual_seed(0)
    pool = KVPool(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu")
    backend = TorchAttentionBackend(pool, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)
    max_lens = [p + e + NUM_DECODE_STEPS for p, e in zip(PREFIX_LENS, EXTEND_LENS, strict=True)]
    tables = page_tables_for(max_lens, shuffled)
    # full per-request q/k/v for every layer and position: [L, T, H, D]
    qs = [torch.randn(NUM_LAYERS, n, NUM_Q_HEADS, HEAD_DIM).to(dtype) for n in max_lens]
    ks = [torch.randn(NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM).to(dtype) for n in max_lens]
    vs = [torch.randn(NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM).to(dtype) for n in max_lens]
    for r, prefix_len in enumerate(PREFIX_LENS):
        slots = torch.tensor(slots_of(tables[r], 0, prefix_len), dtype=torch.long)
        for layer in range(NUM_LAYERS):
            pool.write(layer, slots, ks[r][layer, :prefix_len], vs[r][layer, :prefix_len])

    starts = list(PREFIX_LENS)
    steps = [(ForwardMode.EXTEND, list(EXTEND_LENS))]
    steps += [(ForwardMode.DECODE, [1] * len(max_lens))] * NUM_DECODE_STEPS
    for mode, extend_lens in steps:
        seq_lens = [s + e for s, e in zip(starts, extend_lens, strict=True)]
        out_slots = [
            s for r in range(len(starts)) for s in slots_of(tables[r], starts[r], seq_lens[r])
        ]
        batch = AttentionBatch(
            mode=mode,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            page_tables=tables,
            page_size=PAGE_SIZE,
            out_slots=torch.tensor(out_slots, dtype=torch.long),
        )
        backend.plan(batch)
        for layer in range(NUM_LAYERS):
            rows = [slice(starts[r], seq_lens[r]) for r in range(len(starts))]
            q = torch.cat([qs[r][layer, rows[r]] for r in range(len(rows))])  # [num_tokens, Hq, D]
            k = torch.cat([ks[r][layer, rows[r]] for r in range(len(rows))])
            v = torch.cat([vs[r][layer, rows[r]] for r in range(len(rows))])
            out = backend.forward(layer, q, k, v)
            assert out.shape == q.shape and out.dtype == dtype
            expected = torch.cat(
                [
                    dense_causal_attention(
                        qs[r][layer, : seq_lens[r]],
                        ks[r][layer, : seq_lens[r]],
                        vs[r][layer, : seq_lens[r]],
                        HEAD_DIM**-0.5,
                    )[rows[r]]
                    for r in range(len(rows))
                ]
            )
            torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
        starts = seq_lens


@pytest.mark.parametrize("shuffled", [False, True])
def test_paged_matches_dense_fp32(shuffled: bool) -> None:
    run_paged_vs_dense(torch.float32, shuffled, atol=1e-5)


def test_paged_matches_dense_bf16() -> None:
    run_paged_vs_dense(torch.bfloat16, shuffled=True, atol=2e-2)


def test_registry() -> None:
    pool = KVPool(1, 4, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    backend = create_attention_backend(
        "torch", kv_pool=pool, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM
    )
    assert isinstance(backend, TorchAttentionBackend)
    assert "torch" in supported_attention_backends()
    with pytest.raises(ValueError, match="supported: .*torch"):
        create_attention_backend("nope")
