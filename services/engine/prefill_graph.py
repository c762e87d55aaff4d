"""Piecewise CUDA graphs for short prefill (EXTEND) passes: every layer but its attention.

An eager prefill of a short prompt is bound by kernel launches, not by the GPU. Attention cannot
be captured once for every layout (its plan follows the requests' lengths and pages), so
the pass is cut at each attention call: piece ``i`` is layer ``i - 1``'s output projection,
residual add, norm and MLP, then layer ``i``'s norm, q/k/v projection and rotary with the
K/V store into the pool; piece 0 computes the rotary tables and begins layer 0, the last
piece ends the last layer and applies the final norm. The pieces are captured once per token
size in ``token_sizes`` (largest first, all in one memory pool); a pass of ``n`` tokens runs
the pieces of the smallest size ``T >= n`` and the attention of each layer eagerly between
them, on the pass's real ``n`` rows only.

Every piece reads and writes fixed buffers of ``max(token_sizes)`` rows, sliced to ``T``. Rows
``n .. T-1`` are padding: they carry whatever an earlier pass left (finite values), never mix
with the real rows (every op in a piece is row-wise or a matmul over rows), and store their
K/V in the runner's scratch slot, never in a request's pages. Off CUDA (the CPU tests) the
same pieces run eagerly over the same buffers, padding included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.attention.base import BaseAttentionBackend
from services.engine.kv_cache import KVPool
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel

# Steps of 64 from 128 on: padding costs at most 64 tokens of GPU time. Past the largest size a
# pass is bound by the GPU, not by its launches, and padding only adds work.
DEFAULT_TOKEN_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640)


def token_sizes_up_to(max_tokens: int) -> tuple[int, ...]:
    """The default sizes up to ``max_tokens``, and ``max_tokens`` itself; () for 0 (no graphs)."""
    assert max_tokens >= 0, max_tokens
    if max_tokens == 0:
        return ()
    return tuple(t for t in DEFAULT_TOKEN_SIZES if t < max_tokens) + (max_tokens,)


class PrefillGraphs:
    """The decoder's EXTEND forward for passes of up to ``max_tokens`` tokens (module docstring)."""

    def __init__(
        self,
        model: Qwen2_5_VLModel,
        kv_pool: KVPool,
        scratch_slot: int,  # a pool slot no request owns: the padding rows' K/V go there
        token_sizes: tuple[int, ...] = DEFAULT_TOKEN_SIZES,
    ) -> None:
        assert token_sizes and all(t > 0 for t in token_sizes), token_sizes
        text = model.config.text
        self.model, self.kv_pool = model, kv_pool
        self.layers = model.model.layers
        self.sizes = tuple(sorted(set(token_sizes)))
        self.max_tokens = self.sizes[-1]
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.use_graphs = self.device.type == "cuda"
        rows, hidden = self.max_tokens, text.hidden_size
        num_q_heads, num_kv_heads = model.heads.num_q_heads, model.heads.num_kv_heads  # this rank's
        q_width, kv_width = num_q_heads * text.head_dim, num_kv_heads * text.head_dim

        def buffer(*shape: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self._embeds = buffer(rows, hidden)
        self._positions = buffer(3, rows, dtype=torch.long)
        self._slots = torch.full((rows,), scratch_slot, dtype=torch.long, device=self.device)
        self._scratch_slot = scratch_slot
        self._cos, self._sin = buffer(rows, text.head_dim), buffer(rows, text.head_dim)
        qkv = buffer(rows, q_width + 2 * kv_width)
        heads = (num_q_heads, num_kv_heads, num_kv_heads)
        self._qkv = [
            part.view(rows, h, text.head_dim)
            for part, h in zip(qkv.split([q_width, kv_width, kv_width], dim=1), heads, strict=True)
        ]
        self._attn_out = buffer(rows, num_q_heads, text.head_dim)
        self._residual = buffer(rows, hidden)
        self._hidden = buffer(rows, hidden)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.num_replays = 0  # passes that ran on graphs

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def size_for(self, num_tokens: int) -> int:
        return next(size for size in self.sizes if size >= num_tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size's pieces, largest first (the smaller ones reuse its pool memory)."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graphs = []
            for i in range(len(self.layers) + 1):
                self._piece(i, size)  # warm-up outside the graph: compilation, library handles
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, size)
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,  # [n, hidden] on the device: the pass's merged input embeddings
        positions: torch.Tensor,  # [3, n] int64
        out_slots: torch.Tensor,  # [n] int64: each token's pool slot (the batch's out_slots)
        attention: BaseAttentionBackend,  # planned for this pass (its n tokens)
        logits_indices: torch.Tensor | None = None,  # see Qwen2_5_VLModel.forward
        on_layer_kv: Callable[[int], None] | None = None,  # see LanguageModel.forward
    ) -> torch.Tensor:
        """``model(embeds, positions, attention, logits_indices, on_layer_kv)``, in pieces."""
        n = embeds.shape[0]
        assert self.can_run(n) and positions.shape == (3, n) and out_slots.shape == (n,)
        size = self.size_for(n)
        assert not self.use_graphs or size in self._graphs, "capture() must run before forward()"
        self._embeds[:n].copy_(embeds)
        self._positions[:, :n].copy_(positions, non_blocking=True)
        self._slots[:n].copy_(out_slots, non_blocking=True)
        self._slots[n:size].fill_(self._scratch_slot)
        graphs = self._graphs.get(size)
        q, k, v = (part[:n] for part in self._qkv)
        for i in range(len(self.layers) + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, size)
            if i < len(self.layers):
                self._attn_out[:n].copy_(attention.forward(i, q, k, v, kv_stored=True))
                if on_layer_kv is not None:
                    on_layer_kv(i)
        self.num_replays += graphs is not None
        return self.model.logits(self._hidden[:n], logits_indices)

    def _piece(self, i: int, size: int) -> None:
        """Piece ``i`` at ``size`` rows: the end of layer ``i - 1``, the start of layer ``i``."""
        cos, sin = self._cos[:size], self._sin[:size]
        if i == 0:
            rotary = self.model.model.rotary(self._positions[:, :size], self.dtype)
            cos.copy_(rotary[0])
            sin.copy_(rotary[1])
            x, residual = self._embeds[:size], None
        else:
            x, residual = self.layers[i - 1].end(self._attn_out[:size], self._residual[:size])
        if i == len(self.layers):
            final = self.model.model.norm
            out = final.add_forward(x, residual)[0]
            self._hidden[:size].copy_(out)
            return
        slots = self._slots[:size]
        kv_store = self.kv_pool.store_target(i, slots)
        *qkv, residual = self.layers[i].begin(x, residual, cos, sin, kv_store)
        if kv_store is None:  # an FP8 pool quantizes what it stores
            self.kv_pool.write(i, slots, qkv[1], qkv[2])
        self._residual[:size].copy_(residual)
        for buffer, part in zip(self._qkv, qkv, strict=True):
            buffer[:size].copy_(part)
