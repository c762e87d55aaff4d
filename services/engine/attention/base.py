"""Attention backend contract shared by the torch reference and GPU kernels.

One forward step runs a batch of requests in one mode:
- EXTEND (prefill): request ``r`` brings ``extend_lens[r]`` new tokens whose KV
  positions are ``prefix_lens[r] .. seq_lens[r]-1``; its first ``prefix_lens[r]``
  positions are already in the KV pages (prefix cache or an earlier chunk).
- DECODE: every request brings exactly one new token at position ``seq_lens[r]-1``.

The new tokens of all requests are packed ragged, request by request, in ``q``/``k``/``v``.
The backend first writes the new K/V into the pool at ``out_slots`` (flat index
``page * page_size + offset``), then attends causally: new token ``j`` of request ``r``
sees KV positions ``0 .. prefix_lens[r] + j``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class AttentionBatch:
    """Per-step layout of a batch; the same for every layer of the step."""

    mode: ForwardMode
    seq_lens: list[int]  # total KV length of each request after this step
    extend_lens: list[int]  # new tokens of each request in this step (all 1 in DECODE)
    page_tables: list[list[int]]  # pages of each request, covering seq_lens[r] positions
    page_size: int
    out_slots: torch.Tensor  # [num_new_tokens] int64, where the new K/V go

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True)]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class BaseAttentionBackend(ABC):
    """Paged attention for one model; chosen by name from config."""

    supports_cuda_graph: bool = False  # True: implements init_cuda_graph / plan_cuda_graph

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> None:
        """Build this step's metadata once; every layer's ``forward`` reuses it."""

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        """Write the new K/V of ``layer_id`` into the pool (unless ``kv_stored``: the caller wrote them
        to ``kv_store_target``), then attend over each request's pages."""

    def kv_store_target(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(k_slots, v_slots, out_slots)`` of this step for a caller that stores K/V itself (fused with
        rotary), or None: ``forward`` writes them. Default None."""
        del layer_id
        return None

    def init_cuda_graph(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        """Allocate fixed-address DECODE metadata for each of ``batch_sizes`` (before any capture).

        ``max_num_pages`` bounds the pages of one planned batch, padding rows included.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def plan_cuda_graph(self, batch: AttentionBatch) -> None:
        """``plan`` for a DECODE batch of one of the ``init_cuda_graph`` sizes, into fixed buffers only.

        ``batch.out_slots`` must be a device tensor at a fixed address (graphs read it). A graph
        captured after one call replays correctly after any later call for the same size.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot run inside CUDA graphs")
