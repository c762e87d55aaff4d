"""Where a handoff writes: decode's KV pages (``KvDestination``) and prefill's embedding rows
(``EmbeddingDestination``).

Plain msgspec structs shared by the clients, the servicers and ``services.transfer`` (which
writes to them); importing this module does not import torch.
"""

from __future__ import annotations

import msgspec


class KvPoolLayout(msgspec.Struct, frozen=True):
    """Where a KV pool lives and its layout: ``[num_layers, num_pages, page_size, heads, dim]``."""

    k_base: int  # address of k_buffer in its owner's process
    v_base: int  # address of v_buffer in its owner's process
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    page_nbytes: int  # bytes of one page of one layer in one of K or V
    head_start: int = 0  # the model's first KV head the pool holds (a tensor-parallel rank's)


class KvDestination(msgspec.Struct, frozen=True):
    """Everything prefill needs to write one request's KV into decode's pages."""

    backend: str  # transfer backend that registered the pool ("mooncake", "inprocess", ...)
    session_id: str  # engine address of the decode pool's owner (Mooncake: "host:rpc_port")
    request_id: str
    layout: KvPoolLayout
    page_ids: tuple[int, ...]  # position order: page i of the request is page_ids[i]


class EmbeddingDestination(msgspec.Struct, frozen=True):
    """Where an encoder writes a request's rows; the ``EmbeddingRef`` proto, field for field."""

    # transfer backend that registered the buffer ("shm", "cuda_ipc", "mooncake", "inprocess")
    backend: str
    engine_address: str  # receiver's engine endpoint (Mooncake: "host:rpc_port"); may be session_id
    session_id: str  # receiver's engine session (Mooncake: "host:rpc_port"; in-process: fabric key)
    cp_rank: int  # prefill context-parallel rank owning the buffer
    base_address: int  # address of the window's first row in the receiver's registered memory
    num_rows: int  # rows in the window; row r starts at base_address + r * row_stride_bytes
    row_stride_bytes: int
    hidden_size: int  # elements per row
    dtype: str  # torch dtype name without prefix ("bfloat16")

    @property
    def row_nbytes(self) -> int:
        import torch

        return self.hidden_size * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
