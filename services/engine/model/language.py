"""Qwen2 decoder (GQA, RMSNorm, SwiGLU, M-RoPE) over a paged KV cache.

Tokens of all requests in a step are packed ragged in one ``[num_tokens, hidden]``
tensor; the attention backend holds the step's layout (see attention/base.py).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.attention.base import BaseAttentionBackend
from services.engine.config import TextConfig
from services.engine.model.layers import GatedMLP, RMSNorm
from services.engine.model.rope import MRotaryEmbedding, apply_rotary


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: BaseAttentionBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn.forward(self.layer_id, q, k, v).reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_id)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: BaseAttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """Token embedding, decoder layers and final norm (``model.*`` in the checkpoint)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: BaseAttentionBackend
    ) -> torch.Tensor:
        # input_embeds [T, hidden], positions [3, T] -> hidden states [T, hidden]
        cos, sin = self.rotary(positions, input_embeds.dtype)
        x = input_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)
