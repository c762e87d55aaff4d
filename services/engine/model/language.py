"""Qwen2 / Qwen3 decoder (GQA, RMSNorm, SwiGLU or MoE, M-RoPE) over a paged KV cache.

Tokens of all requests in a step are packed ragged in one ``[num_tokens, hidden]``
tensor; the attention backend holds the step's layout (see attention/base.py). Qwen3
adds RMSNorm over each q and k head, interleaved M-RoPE, MoE layers (``moe.py``) and
DeepStack: the input may carry, next to each token's embedding, one row per DeepStack
layer that is added to that decoder layer's output (zero rows for text tokens).

Under tensor parallelism (``services/engine/parallel.py``) each rank holds its q heads and the
KV heads they read (``HeadLayout``), q/k/v column-parallel and ``o_proj`` row-parallel (its
all-reduce ends the attention), the dense MLP split the same way (``GatedMLP``), its experts of
each MoE layer (expert parallelism, ``SparseMoE``) and its rows of the vocabulary
(``VocabParallelEmbedding``); norms, rotary, routers and the residual stream are whole on every
rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.engine import fp8, ops
from services.engine.attention.base import BaseAttentionBackend
from services.engine.config import TextConfig
from services.engine.model.layers import GatedMLP, RMSNorm, fuse_linears, use_fp8
from services.engine.model.moe import SparseMoE
from services.engine.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from services.engine.model.rope import MRotaryEmbedding
from services.engine.parallel import SINGLE, HeadLayout, Shard, TensorParallel


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        heads = HeadLayout.of(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_heads = heads.num_q_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = d = cfg.head_dim
        q_shard = Shard(0, heads.q_start * d, heads.num_q_heads * d, cfg.num_attention_heads * d)
        kv_shard = Shard(0, heads.kv_start * d, heads.num_kv_heads * d, cfg.num_key_value_heads * d)
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_shard, bias=cfg.qkv_bias)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, kv_shard, bias=cfg.qkv_bias)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, kv_shard, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_shard.total, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_weight: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D, hidden] once fused
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_scale: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D] fp32 with FP8 weights

    def fuse_projections(self) -> None:
        """One matmul for q, k and v (called after the weights are loaded)."""
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def quantize_fp8(self) -> None:
        """FP8 q/k/v (fused, called after ``fuse_projections``) and o weights, scales per
        output channel; the per-layer parameters stay, as e4m3 views with their scales."""
        assert self.qkv_weight is not None
        self.qkv_weight, self.qkv_scale = fp8.quantize_weight(self.qkv_weight)
        start = 0
        for layer in (self.q_proj, self.k_proj, self.v_proj):
            rows = slice(start, start + layer.out_features)
            use_fp8(layer, self.qkv_weight[rows], self.qkv_scale[rows])
            start = rows.stop
        use_fp8(self.o_proj, *fp8.quantize_weight(self.o_proj.weight))

    def project_qkv(
        self,
        h: torch.Tensor,  # [T, hidden], normed
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # see ops.rotary_qk
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k and v [T, Hkv, D]
        if self.qkv_weight is not None:
            qkv = ops.linear(h, self.qkv_weight, self.qkv_bias, self.qkv_scale)  # [T, (Hq+2Hkv)D]
        else:
            qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        if self.q_norm is not None:
            qkv = self.norm_qk(qkv)
        return ops.rotary_qk(
            qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, kv_store
        )

    def norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:  # [T, (Hq + 2 Hkv) * D], same shape
        assert self.q_norm is not None and self.k_norm is not None
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        # per head: [T * H, D]; the widths are spelled out, as T may be 0 (a CP rank's share)
        q = self.q_norm(q.reshape(-1, d)).view(n, self.num_heads * d)
        k = self.k_norm(k.reshape(-1, d)).view(n, self.num_kv_heads * d)
        return torch.cat([q, k, v], dim=-1)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:  # [T, Hq, D] -> [T, hidden]
        out = out.reshape(out.shape[0], self.num_heads * self.head_dim)  # T may be 0 (a CP rank)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_id, tp.attention)
        self.tp = tp
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.is_sparse(layer_id):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp)
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False, tp=tp
            )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def begin(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (not yet added to the residual)
        residual: torch.Tensor | None,  # [T, hidden] running residual stream; None before layer 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # see ops.rotary_qk
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v, residual
        """Everything before attention: the residual add, the norm, q/k/v with rotary (and the
        K/V store into ``kv_store``)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        q, k, v = self.self_attn.project_qkv(h, cos, sin, kv_store)
        return q, k, v, residual

    def end(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, residual stream before it)
        """Everything after attention: output projection, residual add, norm, MLP."""
        h, residual = self.post_attention_layernorm.add_forward(
            self.self_attn.project_out(attn_out), residual
        )
        return self.tp.mlp_rows(self.mlp, h), residual

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: BaseAttentionBackend,
        on_kv: Callable[[], None] | None = None,  # called once this layer's KV store is queued
    ) -> tuple[torch.Tensor, torch.Tensor]:  # see begin and end
        layer_id = self.self_attn.layer_id
        kv_store = attn.kv_store_target(layer_id)  # set: the rotary kernel stores K/V in the pool
        q, k, v, residual = self.begin(x, residual, cos, sin, kv_store)
        out = attn.forward(layer_id, q, k, v, kv_stored=kv_store is not None)
        if on_kv is not None:
            on_kv()
        return self.end(out, residual)


class LanguageModel(nn.Module):
    """Token embedding, decoder layers and final norm (``model.*`` in the checkpoint)."""

    def __init__(
        self, cfg: TextConfig, num_deepstack: int = 0, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.deepstack_layers = tuple(range(num_deepstack))  # layer i adds DeepStack row set i
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp.attention)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved
        )

    def quantize_fp8(self) -> None:
        """FP8 weights for every dense linear of the decoder (``fp8.py``; after
        ``fuse_projections``): attention q/k/v and o, the dense MLPs. MoE experts, the
        embedding, the norms (and the LM head, outside this module) keep their dtype."""
        for layer in self.layers:
            layer.self_attn.quantize_fp8()
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.quantize_fp8()

    def idle(self, dtype: torch.dtype, device: torch.device) -> None:
        """A DP-attention rank's eager step without rows: every layer's MLP joins the group's
        collectives with zero rows of its own (``TensorParallel.mlp_rows``). Where the step
        replays a CUDA graph, the rank replays it all padding instead
        (``CudaGraphDecodeRunner.run_idle``)."""
        x = torch.zeros(0, self.cfg.hidden_size, dtype=dtype, device=device)
        for layer in self.layers:
            layer.tp.mlp_rows(layer.mlp, x)

    def forward(
        self,
        input_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: BaseAttentionBackend,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        # input_embeds [T, hidden] or, with DeepStack rows, [T, hidden * (1 + num_deepstack)];
        # positions [3, T] -> hidden states [T, hidden]
        # on_layer_kv(i): called once layer i's attention (its KV store included) is queued, before
        # its MLP: a copy of that KV queued then on another stream overlaps the MLP
        hidden = self.cfg.hidden_size
        deepstack = (
            input_embeds[:, hidden:].split(hidden, 1) if input_embeds.shape[1] > hidden else ()
        )
        assert len(deepstack) in (0, len(self.deepstack_layers)), (input_embeds.shape, hidden)
        cos, sin = self.rotary(positions, input_embeds.dtype)  # [T, D] each, once per step
        x, residual = input_embeds[:, :hidden].contiguous(), None
        for i, layer in enumerate(self.layers):
            on_kv = None if on_layer_kv is None else (lambda i=i: on_layer_kv(i))
            x, residual = layer(x, residual, cos, sin, attn, on_kv)
            if deepstack and i in self.deepstack_layers:
                x = x + deepstack[self.deepstack_layers.index(i)]
        return self.norm.add_forward(x, residual)[0]
