"""Paged attention in plain torch: the reference backend, on any device and dtype.

Each step gathers every request's KV rows from the pool by slot id (``KVPool.read``: an FP8
pool's upcast and scaled) and runs ``scaled_dot_product_attention`` in fp32 with an explicit
causal mask, one request at a time. Slow, simple and exact; the GPU kernels are checked
against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.attention.base import AttentionBatch, BaseAttentionBackend, ForwardMode
from services.engine.kv_cache import KVPool


@dataclass
class _RequestPlan:
    query_start: int  # first row of this request in the packed q/k/v
    extend_len: int
    gather_slots: (
        torch.Tensor
    )  # [seq_len] int64 on the pool device, slots of positions 0..seq_len-1
    mask: torch.Tensor | None  # [extend_len, seq_len] bool, True = may attend; None = attend to all


@dataclass
class _StepPlan:
    num_tokens: int
    out_slots: torch.Tensor  # [num_tokens] int64 on the pool device
    requests: list[_RequestPlan]


def gather_slot_ids(page_table: list[int], seq_len: int, page_size: int) -> torch.Tensor:
    """Flat slot ids (int64, CPU) of positions ``0 .. seq_len-1`` of a request with ``page_table``."""
    assert len(page_table) * page_size >= seq_len, (
        f"{len(page_table)} pages of {page_size} cannot hold {seq_len} positions"
    )
    positions = torch.arange(seq_len, dtype=torch.long)
    pages = torch.tensor(page_table, dtype=torch.long)[positions // page_size]
    return pages * page_size + positions % page_size


def causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """``[extend_len, prefix_len + extend_len]`` bool: new token ``j`` sees positions ``0 .. prefix_len + j``."""
    rows = torch.arange(extend_len, device=device).unsqueeze(1)  # [extend_len, 1]
    cols = torch.arange(prefix_len + extend_len, device=device).unsqueeze(0)  # [1, seq_len]
    return cols <= rows + prefix_len


class TorchAttentionBackend(BaseAttentionBackend):
    """Reference paged attention over a ``KVPool``; GQA by repeating KV heads."""

    def __init__(
        self,
        kv_pool: KVPool,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
    ) -> None:
        assert num_q_heads % num_kv_heads == 0, (
            f"{num_q_heads} q heads not a multiple of {num_kv_heads}"
        )
        assert kv_pool.num_kv_heads == num_kv_heads and kv_pool.head_dim == head_dim
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_q_per_kv = num_q_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim**-0.5
        self._plan: _StepPlan | None = None

    def plan(self, batch: AttentionBatch) -> None:
        assert batch.page_size == self.kv_pool.page_size, "batch and pool page sizes differ"
        if batch.mode is ForwardMode.DECODE:
            assert all(e == 1 for e in batch.extend_lens), "DECODE brings one token per request"
        assert batch.out_slots.shape == (batch.num_tokens,), (
            f"out_slots {tuple(batch.out_slots.shape)} != ({batch.num_tokens},)"
        )
        device = self.kv_pool.device
        requests: list[_RequestPlan] = []
        query_start = 0
        for seq_len, extend_len, page_table in zip(
            batch.seq_lens, batch.extend_lens, batch.page_tables, strict=True
        ):
            assert 0 < extend_len <= seq_len, f"extend_len {extend_len} vs seq_len {seq_len}"
            prefix_len = seq_len - extend_len
            slots = gather_slot_ids(page_table, seq_len, batch.page_size).to(device)
            mask = None if extend_len == 1 else causal_mask(prefix_len, extend_len, device)
            requests.append(_RequestPlan(query_start, extend_len, slots, mask))
            query_start += extend_len
        out_slots = batch.out_slots.to(device=device, dtype=torch.long)
        self._plan = _StepPlan(num_tokens=query_start, out_slots=out_slots, requests=requests)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        plan = self._plan
        assert plan is not None, "plan(batch) must run before forward"
        assert q.shape == (plan.num_tokens, self.num_q_heads, self.head_dim), tuple(q.shape)
        if not kv_stored:
            self.kv_pool.write(layer_id, plan.out_slots, k, v)
        out = torch.empty_like(q)
        for req in plan.requests:
            rows = slice(req.query_start, req.query_start + req.extend_len)
            k_seq, v_seq = self.kv_pool.read(layer_id, req.gather_slots)  # FP8 pages dequantized
            out[rows] = self._attend_one(q[rows], k_seq, v_seq, req.mask)
        return out

    def _attend_one(
        self,
        q: torch.Tensor,  # [extend_len, num_q_heads, head_dim]
        k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
        v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
        mask: torch.Tensor | None,  # [extend_len, seq_len] bool
    ) -> torch.Tensor:  # [extend_len, num_q_heads, head_dim], dtype of q
        q32 = q.float().transpose(0, 1)  # [num_q_heads, extend_len, head_dim] fp32
        k32 = (
            k.float().repeat_interleave(self.num_q_per_kv, dim=1).transpose(0, 1)
        )  # [Hq, seq_len, D]
        v32 = (
            v.float().repeat_interleave(self.num_q_per_kv, dim=1).transpose(0, 1)
        )  # [Hq, seq_len, D]
        out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1).to(q.dtype)
