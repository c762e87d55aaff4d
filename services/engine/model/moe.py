"""Sparse mixture-of-experts MLP (Qwen3-MoE style): a softmax router picks the top-k
experts of each token, each expert is a SwiGLU MLP, and the token's output is the
routing-weighted sum of its experts' outputs.

The expert weights of a layer are one tensor each, in the layout transformers holds and
saves: ``experts.gate_up_proj`` ``[E, 2 * I, hidden]`` (gate rows first) and
``experts.down_proj`` ``[E, hidden, I]``; the router is ``gate.weight`` ``[E, hidden]``.
Released Qwen3-VL-MoE checkpoints store the experts transposed (``[E, hidden, 2 * I]``,
``[E, I, hidden]``); ``checkpoint_expert`` takes either, as transformers does. This is the
torch reference path: one matmul pair per expert that some token picked (the picked set
is read on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.config import MoEConfig
from services.engine.model.layers import activation


class Experts(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))


EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def checkpoint_expert(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A stacked expert tensor in the model's ``shape``, from either checkpoint layout: kept
    when it has ``shape`` already (transformers' rule, also where both layouts agree), else
    transposed when its last two dims are swapped; else returned as is (a shape error)."""
    if tuple(tensor.shape) != shape and tuple(tensor.transpose(1, 2).shape) == shape:
        return tensor.transpose(1, 2).contiguous()
    return tensor


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] in the logits' dtype, experts [T, k]
    """Softmax over all experts in fp32, the top-k of it, renormalized to sum 1 when asked."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, act: str) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(hidden_size, moe)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, experts = route(
            self.gate(x), self.moe.num_experts_per_tok, self.moe.norm_topk_prob
        )
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == expert)
            gate_up = F.linear(x[token_idx], self.experts.gate_up_proj[expert])  # [n, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.experts.down_proj[expert])  # [n, hidden]
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        return out
