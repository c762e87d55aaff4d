"""Paged attention on flashinfer (CUDA): ragged prefill over cached prefixes, and decode.

The pool's per-layer K and V tensors ``[num_pages, page_size, num_kv_heads, head_dim]``
are flashinfer's NHD paged layout, passed as a ``(k_cache, v_cache)`` tuple. ``plan``
turns the step's page tables into flashinfer's CSR metadata (``indptr`` / ``indices``
/ ``last_page_len``) once; every layer's ``forward`` writes its new K/V at
``out_slots`` and runs the planned wrapper:
- EXTEND: ``BatchPrefillWithPagedKVCacheWrapper``, causal, so new token ``j`` of a
  request sees its prefix and new tokens ``0..j``;
- DECODE: ``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores (needed for GQA
  groups such as 28 query / 4 KV heads).
For CUDA graphs, one decode wrapper per captured batch size owns fixed-address metadata
buffers; ``plan_cuda_graph`` rewrites them before each replay.
An FP8 pool's pages are planned as ``kv_data_type`` e4m3 (q stays in the model's dtype) and
each layer's run gets its scales (``k_scale`` folds into the softmax scale, ``v_scale``
multiplies the output); the pool's ``write`` quantizes the new K/V, not the rotary kernel.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from services.engine.attention.base import AttentionBatch, BaseAttentionBackend, ForwardMode
from services.engine.kv_cache import KVPool

WORKSPACE_BYTES = 256 * 1024 * 1024  # flashinfer's split-KV scratch; shared by all wrappers


def import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            "the 'flashinfer' attention backend needs flashinfer-python: install the `gpu` extra "
            "(pip install 'stageserve[gpu]'), or choose attention_backend='torch'"
        ) from exc
    return flashinfer


@dataclass(frozen=True)
class PagedKVMetadata:
    """flashinfer's CSR view of a batch; int32 CPU tensors."""

    qo_indptr: torch.Tensor  # [B + 1] offsets of each request's new tokens
    kv_indptr: torch.Tensor  # [B + 1] offsets of each request's pages in kv_indices
    kv_indices: torch.Tensor  # [total pages] page ids, request by request, in position order
    kv_last_page_len: torch.Tensor  # [B] positions used in each request's last page (1..page_size)


def paged_kv_metadata(batch: AttentionBatch) -> PagedKVMetadata:
    page_size = batch.page_size
    seq_lens = np.asarray(batch.seq_lens, dtype=np.int64)
    num_pages = (seq_lens + page_size - 1) // page_size
    for table, needed in zip(batch.page_tables, num_pages.tolist(), strict=True):
        assert len(table) >= needed, (
            f"{len(table)} pages cannot hold {needed * page_size} positions"
        )
    total = int(num_pages.sum())
    chunks = (
        table[:needed] for table, needed in zip(batch.page_tables, num_pages.tolist(), strict=True)
    )
    indices = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int32, count=total)
    kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=kv_indptr[1:])
    qo_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(np.asarray(batch.extend_lens, dtype=np.int64), out=qo_indptr[1:])
    last_page_len = (seq_lens - (num_pages - 1) * page_size).astype(np.int32)
    return PagedKVMetadata(
        torch.from_numpy(qo_indptr),
        torch.from_numpy(kv_indptr),
        torch.from_numpy(indices),
        torch.from_numpy(last_page_len),
    )


class FlashInferAttentionBackend(BaseAttentionBackend):
    """flashinfer paged prefill and decode over a ``KVPool`` on one CUDA device."""

    supports_cuda_graph = True

    def __init__(
        self,
        kv_pool: KVPool,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        prefill_backend: str = "auto",  # flashinfer's choice: fa3 on Hopper, fa2 elsewhere
    ) -> None:
        self._fi = import_flashinfer()
        assert kv_pool.device.type == "cuda", (
            "the flashinfer backend needs the KV pool on a CUDA device"
        )
        assert num_q_heads % num_kv_heads == 0 and kv_pool.num_kv_heads == num_kv_heads
        assert kv_pool.head_dim == head_dim
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self.device = self.workspace.device  # with its index: "cuda" becomes "cuda:0"
        self.prefill_wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend
        )
        self.decode_wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self._graph_wrappers: dict[int, Any] = {}
        self._indices_host: torch.Tensor | None = None  # [max pages] int32 pinned
        self._indices_stage: torch.Tensor | None = None  # [max pages] int32 on device
        self._active: Any = None
        self._out_slots: torch.Tensor | None = None
        # plan() writes pinned host memory (flashinfer's plan info, our page indices) and uploads it
        # asynchronously; before the next plan rewrites it, the previous upload must have run.
        self._planned = torch.cuda.Event()

    def _plan_kwargs(self) -> dict[str, Any]:
        return {
            "q_data_type": self.kv_pool.value_dtype,
            "kv_data_type": self.kv_pool.dtype,
            "sm_scale": self.scale,
        }

    def _plan_decode(self, wrapper: Any, meta: PagedKVMetadata, indices: torch.Tensor) -> None:
        wrapper.plan(
            meta.kv_indptr,
            indices,
            meta.kv_last_page_len,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.kv_pool.page_size,
            **self._plan_kwargs(),
        )

    def plan(self, batch: AttentionBatch) -> None:
        assert batch.page_size == self.kv_pool.page_size, "batch and pool page sizes differ"
        assert batch.out_slots.shape == (batch.num_tokens,)
        meta = paged_kv_metadata(batch)
        self._planned.synchronize()
        if batch.mode is ForwardMode.DECODE:
            assert all(e == 1 for e in batch.extend_lens), "DECODE brings one token per request"
            self._plan_decode(self.decode_wrapper, meta, meta.kv_indices)
            self._active = self.decode_wrapper
        else:
            self.prefill_wrapper.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self.kv_pool.page_size,
                causal=True,
                **self._plan_kwargs(),
            )
            self._active = self.prefill_wrapper
        self._planned.record()
        self._out_slots = batch.out_slots.to(
            device=self.device, dtype=torch.long, non_blocking=True
        )

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        assert self._active is not None and self._out_slots is not None, (
            "plan(batch) must run before forward"
        )
        if not kv_stored:
            self.kv_pool.write(layer_id, self._out_slots, k, v)
        kv_cache = (
            self.kv_pool.k_cache[layer_id],
            self.kv_pool.v_cache[layer_id],
        )  # NHD, per layer
        scales = self.kv_pool.scales
        if scales is None:
            return self._active.run(q, kv_cache)
        return self._active.run(q, kv_cache, k_scale=scales.k[layer_id], v_scale=scales.v[layer_id])

    def kv_store_target(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The pool's slots for this step: the decoder stores K/V in its rotary kernel (one launch
        fewer); None for an FP8 pool (``forward`` writes them, quantized)."""
        assert self._out_slots is not None, "plan(batch) must run before kv_store_target"
        return self.kv_pool.store_target(layer_id, self._out_slots)

    def init_cuda_graph(self, batch_sizes: list[int] | tuple[int, ...], max_num_pages: int) -> None:
        self._indices_host = torch.zeros(max_num_pages, dtype=torch.int32, pin_memory=True)
        self._indices_stage = torch.zeros(max_num_pages, dtype=torch.int32, device=self.device)
        indices_buffer = torch.zeros(max_num_pages, dtype=torch.int32, device=self.device)
        for size in batch_sizes:
            self._graph_wrappers[size] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=indices_buffer,  # one at a time: sizes share it
                paged_kv_last_page_len_buffer=torch.ones(
                    size, dtype=torch.int32, device=self.device
                ),
            )

    def plan_cuda_graph(self, batch: AttentionBatch) -> None:
        assert batch.mode is ForwardMode.DECODE and batch.out_slots.device == self.device
        wrapper = self._graph_wrappers[len(batch.seq_lens)]
        assert self._indices_host is not None and self._indices_stage is not None
        meta = paged_kv_metadata(batch)
        n = meta.kv_indices.numel()
        assert n <= self._indices_host.numel(), (
            f"{n} pages exceed the graph's {self._indices_host.numel()}"
        )
        # pinned staging keeps the upload asynchronous (flashinfer copies a CPU index list synchronously)
        self._planned.synchronize()
        self._indices_host[:n].copy_(meta.kv_indices)
        self._indices_stage[:n].copy_(self._indices_host[:n], non_blocking=True)
        self._plan_decode(wrapper, meta, self._indices_stage[:n])
        self._planned.record()
        self._active = wrapper
        self._out_slots = batch.out_slots
