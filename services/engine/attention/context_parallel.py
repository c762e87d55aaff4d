"""Context-parallel attention: one rank's share of an EXTEND pass sharded over C ranks.

A pass packs its requests' new tokens in one stream; the stream is cut into blocks of
``block_tokens`` and block ``b`` goes to rank ``b % C`` (``CpShard``). Each rank embeds
and projects only its tokens, and per layer:
  1. all-gathers the new K/V rows of every rank over the device group (``KvExchange``);
  2. writes the whole pass's K/V into its own pages (every rank holds the full KV);
  3. attends with its own queries over the full causal context. A run of consecutive
     local tokens ``[a, b)`` of one request is an ordinary EXTEND request of prefix ``a``,
     so any paged backend (torch, flashinfer) runs the local queries unchanged.
A rank that fails mid-pass still joins the pass's remaining all-gathers with a poison flag
(``KvExchange.poison_rest``); every rank reads the flags once the pass ends
(``peer_failed``), so a failure never leaves a peer waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.attention.base import AttentionBatch, BaseAttentionBackend, ForwardMode
from services.engine.kv_cache import KVPool

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class CpShard:
    """Which tokens of a packed pass stream belong to ``rank`` of ``world_size``."""

    rank: int
    world_size: int
    block_tokens: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size and self.block_tokens > 0

    def owner(self, index: int) -> int:
        """The rank that holds packed token ``index``."""
        return (index // self.block_tokens) % self.world_size

    def local_indices(self, num_tokens: int, rank: int | None = None) -> list[int]:
        """Packed indices of ``rank``'s tokens (this rank by default), ascending."""
        rank = self.rank if rank is None else rank
        if self.world_size == 1:
            return list(range(num_tokens))
        block, step = self.block_tokens, self.block_tokens * self.world_size
        indices: list[int] = []
        for start in range(rank * block, num_tokens, step):
            indices.extend(range(start, min(start + block, num_tokens)))
        return indices

    def sizes(self, num_tokens: int) -> list[int]:
        """Tokens of each rank in a pass of ``num_tokens``."""
        block, step = self.block_tokens, self.block_tokens * self.world_size
        full, rest = divmod(num_tokens, step)
        return [full * block + min(max(rest - r * block, 0), block) for r in range(self.world_size)]


def local_runs(
    positions: Sequence[int], page_table: list[int], page_size: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """``(seq_lens, extend_lens, page_tables)`` of the EXTEND requests that are the runs of
    consecutive ``positions`` (ascending KV positions of one request's local queries)."""
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    for pos in positions:
        if seq_lens and seq_lens[-1] == pos:
            seq_lens[-1] += 1
            extend_lens[-1] += 1
        else:
            seq_lens.append(pos + 1)
            extend_lens.append(1)
    del page_size  # every run shares the request's page table
    return seq_lens, extend_lens, [page_table] * len(seq_lens)


class KvExchange:
    """The all-gathers of one pass: ``num_gathers`` calls, each of ``sizes[r]`` rows from rank r.

    Each rank sends ``max(sizes) + 1`` rows; the extra row carries its poison flag. Rows
    come back rank-major (rank 0's rows, then rank 1's, ...).
    """

    def __init__(
        self,
        group: ProcessGroup | None,
        rank: int,
        sizes: Sequence[int],
        num_gathers: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.group, self.rank, self.sizes = group, rank, list(sizes)
        self.num_gathers, self.width = num_gathers, width
        self.dtype, self.device = dtype, device
        self.num_done = 0
        self._flags = torch.zeros((), dtype=torch.float32, device=device)  # sum of peers' flags

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[sizes[rank], width] local rows -> [sum(sizes), width], rank-major."""
        assert rows.shape == (self.sizes[self.rank], self.width), tuple(rows.shape)
        return self._gather(rows, poison=False)

    def poison_rest(self) -> None:
        """Join the gathers this rank still owes with the poison flag set (it failed)."""
        while self.num_done < self.num_gathers:
            self._gather(None, poison=True)

    def peer_failed(self) -> bool:
        """Whether some rank sent a poison flag in this pass (one host sync)."""
        return bool(self._flags.item() > 0)

    def _gather(self, rows: torch.Tensor | None, poison: bool) -> torch.Tensor:
        import torch.distributed as dist

        assert self.num_done < self.num_gathers, "more gathers than the pass has"
        max_rows = max(self.sizes)
        buf = torch.zeros(max_rows + 1, self.width, dtype=self.dtype, device=self.device)
        if rows is not None:
            buf[: rows.shape[0]] = rows
        buf[max_rows, 0] = 1.0 if poison else 0.0
        out = [torch.empty_like(buf) for _ in self.sizes]
        dist.all_gather(out, buf, group=self.group)
        self.num_done += 1
        self._flags += torch.stack([o[max_rows, 0].float() for o in out]).sum()
        return torch.cat([o[:n] for o, n in zip(out, self.sizes, strict=True)])


class ContextParallelAttention(BaseAttentionBackend):
    """Wraps a paged backend: gathers every rank's new K/V, stores them all, attends locally.

    ``plan(batch)`` takes the local runs' EXTEND batch (see ``local_runs``); ``begin_pass``
    names the pass's exchange and the slots of the gathered rows (rank-major).
    """

    def __init__(self, inner: BaseAttentionBackend, kv_pool: KVPool) -> None:
        self.inner = inner
        self.kv_pool = kv_pool
        self._exchange: KvExchange | None = None
        self._slots: torch.Tensor | None = None
        self._has_queries = False

    def begin_pass(self, exchange: KvExchange, gathered_slots: torch.Tensor) -> None:
        """``gathered_slots`` [sum(sizes)] int64: the pool slot of each gathered row."""
        assert gathered_slots.shape == (sum(exchange.sizes),)
        self._exchange = exchange
        self._slots = gathered_slots.to(device=self.kv_pool.device, dtype=torch.long)

    def plan(self, batch: AttentionBatch) -> None:
        """Plan the local queries; a rank with none still stores and gathers (no kernel planned)."""
        assert batch.mode is ForwardMode.EXTEND, "context parallelism shards EXTEND passes only"
        self._has_queries = bool(batch.seq_lens)
        if self._has_queries:
            self.inner.plan(batch)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_local, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_local, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_local, num_q_heads, head_dim]
        exchange, slots = self._exchange, self._slots
        assert exchange is not None and slots is not None, "begin_pass before forward"
        assert not kv_stored, "the gathered K/V are stored here"
        n, heads, dim = k.shape
        local = torch.cat(
            [k.reshape(n, heads * dim), v.reshape(n, heads * dim)], dim=1
        )  # [n, 2 Hkv D]
        gathered = exchange.gather(local.to(exchange.device, exchange.dtype)).to(
            k.device
        )  # [total, 2 Hkv D]
        k_all, v_all = gathered.split(heads * dim, dim=1)
        total = gathered.shape[0]
        self.kv_pool.write(
            layer_id,
            slots,
            k_all.reshape(total, heads, dim).to(k.dtype),
            v_all.reshape(total, heads, dim).to(v.dtype),
        )
        if not self._has_queries:
            return torch.empty_like(q)
        return self.inner.forward(layer_id, q, k, v, kv_stored=True)
