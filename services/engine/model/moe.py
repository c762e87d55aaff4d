"""Sparse mixture-of-experts MLP (Qwen3-MoE style): a softmax router picks the top-k
experts of each token, each expert is a SwiGLU MLP, and the token's output is the
routing-weighted sum of its experts' outputs.

The expert weights of a layer are one tensor each, in the layout transformers holds and
saves: ``experts.gate_up_proj`` ``[E, 2 * I, hidden]`` (gate rows first) and
``experts.down_proj`` ``[E, hidden, I]``; the router is ``gate.weight`` ``[E, hidden]``.
Released Qwen3-VL-MoE checkpoints store the experts transposed (``[E, hidden, 2 * I]``,
``[E, I, hidden]``); ``checkpoint_expert`` takes either, as transformers does.

Three forwards, one result. Each sorts the T * k (token, expert) pairs by expert on the
device and takes the per-expert row ends from a ``searchsorted`` over the sorted ids:

- **triton** (what runs on CUDA once ``fuse_projections`` has prepared the weights, where
  Triton is installed): each expert's pairs padded to whole row blocks (``block_layout``),
  both expert matmuls as one Triton grouped GEMM each (``triton_moe``) that gathers the
  token rows itself and writes each pair's row in (token, slot) order, the second with its
  routing weight applied, so the combine is one sum over the k rows. Nothing is read on the
  host: the layer captures in a CUDA graph on any GPU.
- **grouped** (elsewhere once prepared): the pairs' rows gathered in expert order, both
  matmuls as ``torch.nn.functional.grouped_mm``, the rows weighted, put back in (token,
  slot) order and summed. Every shape depends on T and k only, and nothing is read on the
  host, so the layer can be captured in a CUDA graph where the grouped GEMM itself does not
  sync (see ``grouped_mm_syncs_host``).
- **reference** (the test oracle, and the fallback where torch has no grouped GEMM or
  ``hidden`` is not 16-byte aligned): one matmul pair per expert that some token picked;
  the picked set is read on the host, so it syncs and cannot be captured.

Under expert parallelism (``TensorParallel.ep_size`` > 1, over the TP group) each rank holds
``num_experts / ep_size`` consecutive experts (``Experts.tp_shards``: the loader reads only
them) and every token, replicated on every rank after the attention's all-reduce. Each rank
routes all its tokens with the whole (replicated) router and computes the pairs whose expert it
holds: the grouped forward sorts the other ranks' pairs after its own, past the last group end,
where the grouped GEMM leaves them unwritten, and zeroes them; shapes stay those of the single
rank. One all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import ops
from services.engine.config import MoEConfig
from services.engine.model.layers import PAD_INTERMEDIATE, activation
from services.engine.parallel import SINGLE, Shard, TensorParallel

logger = logging.getLogger(__name__)

ALIGN_BYTES = 16  # grouped GEMM operands: row strides and base pointers (torch checks strides)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_FAST_GROUPED_MM_SM = (9, 10)  # torch's CUTLASS grouped GEMM (bf16); others: a synced loop
# Calls over at most this many tokens (batch-1 decode) run torch's grouped GEMM where it captures:
# measured faster there than the Triton forward, whose layout adds a dozen small kernels; from 64
# tokens on the Triton forward is faster (docs/benchmarks.md, "MoE layer").
GROUPED_MAX_TOKENS = 1


class Experts(nn.Module):
    """Experts ``shard`` (dim 0) of a layer's stacked expert tensors, named in ``tp_shards``."""

    def __init__(self, hidden_size: int, moe: MoEConfig, shard: Shard) -> None:
        super().__init__()
        e, i = shard.size, moe.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))
        self.tp_shards = {"gate_up_proj": shard, "down_proj": shard}


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


def grouped_mm_syncs_host(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM reads the group ends on the host here. On CUDA only bf16
    on SM 9.x / 10.x runs its CUTLASS kernel; every other CUDA case runs torch's per-group
    fallback, which copies the ends to the host (and so cannot be captured in a graph)."""
    if device.type != "cuda":
        return False
    major = torch.cuda.get_device_capability(device)[0]
    return dtype != torch.bfloat16 or major not in _FAST_GROUPED_MM_SM


def _aligned(num_elements: int, dtype: torch.dtype) -> bool:
    return num_elements * dtype.itemsize % ALIGN_BYTES == 0


def _realigned(param: nn.Parameter) -> torch.Tensor:
    """``param``'s data, first replaced by a copy (same values) when it does not start on an
    ``ALIGN_BYTES`` boundary (a tensor mapped straight from a safetensors file may not)."""
    if param.data_ptr() % ALIGN_BYTES:
        param.data = param.detach().clone()
    return param.detach()


def block_layout(
    order: torch.Tensor,  # [P] pair index (token * k + slot) of each position sorted by expert
    ends: torch.Tensor,  # [E] cumulative end of each expert's run in that order
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [S] pair of each slot (P: padding), [S / block_m] experts
    """The Triton forward's layout: each expert's pairs padded to whole blocks of ``block_m``
    slots, as the pair index of every slot and the expert of every block (-1 past the last
    expert's blocks; pairs after ``ends[-1]``, another rank's, are in no block). ``S`` is the
    most slots any routing needs, ``P + E * (block_m - 1)`` rounded up to a block, so every
    shape is static and nothing is read on the host."""
    num_pairs, num_experts = order.numel(), ends.numel()
    ends = ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    num_slots = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    slots = torch.arange(num_slots, device=order.device)
    expert = torch.searchsorted(padded_ends, slots, right=True)  # num_experts past the last run
    in_run = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    row = slots - padded_starts[expert]  # the slot's row within its expert's padded run
    is_pair = in_run & (row < counts[expert])
    position = (ends[expert] - counts[expert] + row).clamp(max=max(num_pairs - 1, 0))
    pair_of_slot = torch.where(is_pair, order[position], num_pairs).to(torch.int32)
    block_expert = torch.where(in_run, expert, -1)[::block_m].to(torch.int32)
    return pair_of_slot, block_expert


class SparseMoE(nn.Module):
    def __init__(
        self, hidden_size: int, moe: MoEConfig, act: str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.moe = moe
        self.tp = tp
        self.expert_shard = tp.experts(moe.num_experts)  # the experts this rank holds
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(hidden_size, moe, self.expert_shard)
        self.act_name = act
        self.act = activation(act)
        self.gate_up_t: torch.Tensor | None = None  # [E held, hidden, 2I'] once prepared
        self.down_t: torch.Tensor | None = None  # [E held, I', hidden] once prepared
        self.syncs_host = True  # False once the grouped forward runs without host reads
        self.kernels: ModuleType | None = None  # triton_moe once prepared on CUDA
        self.grouped_captures = False  # torch's grouped GEMM runs without host reads here

    def fuse_projections(self) -> None:
        """Prepare the grouped forward (called once after the weights are loaded).

        The grouped GEMM takes ``[E, in, out]`` operands: transposed views of the loaded
        tensors, no copy. Where ``I`` rows are not 16-byte aligned, gate/up get zero rows and
        down zero columns up to a multiple of ``PAD_INTERMEDIATE`` (act(0) * 0 = 0: the output
        is unchanged); that padded pair is a copy, next to the unchanged parameters. Where
        torch has no grouped GEMM or ``hidden`` is not aligned, the reference forward stays.
        """
        gate_up = _realigned(self.experts.gate_up_proj)  # [E, 2I, hidden]
        down = _realigned(self.experts.down_proj)  # [E, hidden, I]
        hidden, inter = down.shape[1], down.shape[2]
        if _GROUPED_MM is None or not _aligned(hidden, down.dtype):
            logger.info("MoE: reference forward (grouped GEMM unavailable or hidden unaligned)")
            return
        if not _aligned(inter, down.dtype):
            padded = -(-inter // PAD_INTERMEDIATE) * PAD_INTERMEDIATE
            gate, up = gate_up.chunk(2, dim=1)
            gate_up = torch.cat([F.pad(t, (0, 0, 0, padded - inter)) for t in (gate, up)], 1)
            down = F.pad(down, (0, padded - inter))
        self.gate_up_t = gate_up.transpose(1, 2)
        self.down_t = down.transpose(1, 2)
        self.kernels = ops.moe_kernels(down)
        self.grouped_captures = not grouped_mm_syncs_host(down.device, down.dtype)
        self.syncs_host = self.kernels is None and not self.grouped_captures

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, experts = route(
            self.gate(x), self.moe.num_experts_per_tok, self.moe.norm_topk_prob
        )
        kind = self.forward_kind(x.shape[0])
        if kind == "reference":
            out = self.reference_forward(x, weights, experts)
        else:
            out = self.pairs_forward(x, weights, experts, kind)
        return out if self.tp.ep_size == 1 else self.tp.sum_partials(out)

    def forward_kind(self, num_tokens: int) -> str:
        """The forward a call over ``num_tokens`` runs: "reference" until prepared, "triton" on
        CUDA with Triton (but "grouped" up to ``GROUPED_MAX_TOKENS`` where that captures), else
        "grouped"."""
        if self.gate_up_t is None:
            return "reference"
        if self.kernels is None or (num_tokens <= GROUPED_MAX_TOKENS and self.grouped_captures):
            return "grouped"
        return "triton"

    @property
    def holds_all_experts(self) -> bool:
        return self.expert_shard.size == self.expert_shard.total

    def local_expert_ids(self, experts: torch.Tensor) -> torch.Tensor:  # [T, k] -> [T * k]
        """Each pair's expert among this rank's, or the number of them for another rank's
        expert (so it sorts after every pair of this rank's)."""
        if self.holds_all_experts:
            return experts.flatten()
        local = experts.flatten() - self.expert_shard.start
        held = (local >= 0) & (local < self.expert_shard.size)
        return torch.where(held, local, self.expert_shard.size)

    def sort_pairs(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs sorted by this rank's expert id (stable): the sorted ids, the pair index at
        each sorted position, and each expert's cumulative end. The ends come from
        ``searchsorted``, not ``bincount``: CUDA's bincount sizes its output from the ids' max,
        read on the host."""
        assert self.gate_up_t is not None
        sorted_ids, order = torch.sort(self.local_expert_ids(experts), stable=True)  # [T * k]
        bounds = torch.arange(1, self.gate_up_t.shape[0] + 1, device=experts.device)
        ends = torch.searchsorted(sorted_ids, bounds, out_int32=True)
        return sorted_ids, order, ends

    def pairs_forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        weights: torch.Tensor,  # [T, k] routing weights
        experts: torch.Tensor,  # [T, k] int64 expert ids
        kind: str,  # "triton" or "grouped"
    ) -> torch.Tensor:  # [T, hidden]
        """This rank's experts' part of the output (another rank's pairs count as zero): sort
        the pairs by expert, run both expert GEMMs over them the ``kind`` way, sum each token's
        k weighted rows."""
        assert self.gate_up_t is not None and self.down_t is not None
        num_tokens, top_k = experts.shape
        if num_tokens == 0:  # a CP rank's empty share: no GEMM over zero rows
            return torch.zeros_like(x)
        sorted_ids, order, ends = self.sort_pairs(experts)
        run = self._triton_pairs if kind == "triton" else self._grouped_pairs
        out = run(x, weights.flatten(), top_k, sorted_ids, order, ends)  # [T * k, hidden]
        return out.view(num_tokens, top_k, x.shape[1]).sum(dim=1)

    def _triton_pairs(self, x, weights, top_k, sorted_ids, order, ends) -> torch.Tensor:
        """Each pair's weighted row in (token, slot) order, by the Triton grouped GEMMs: the
        first gathers its token rows, the second weights and stores each row at its pair;
        another rank's pairs are in no block and stay zero."""
        assert self.kernels is not None and self.gate_up_t is not None and self.down_t is not None
        num_pairs = order.numel()
        config = self.kernels.tile_config(num_pairs)
        layout = block_layout(order, ends, config.block_m)
        gate_up = x.new_empty(num_pairs, self.gate_up_t.shape[2])
        self.kernels.moe_gemm(x, self.gate_up_t, gate_up, *layout, config, a_row_div=top_k)
        act = ops.gated_act(gate_up, self.act_name, self.act)  # [T * k, I']
        new = x.new_empty if self.holds_all_experts else x.new_zeros
        out = new(num_pairs, x.shape[1])
        gemm = self.kernels.moe_gemm
        return gemm(act, self.down_t, out, *layout, config, a_row_div=1, weights=weights)

    def _grouped_pairs(self, x, weights, top_k, sorted_ids, order, ends) -> torch.Tensor:
        """Each pair's weighted row in (token, slot) order, by torch's grouped GEMM over the
        rows gathered in expert order; another rank's pairs are zeroed."""
        assert self.gate_up_t is not None and self.down_t is not None and _GROUPED_MM is not None
        rows = x[order // top_k]  # [T * k, hidden], grouped by expert
        gate_up = _GROUPED_MM(rows, self.gate_up_t, offs=ends)  # [T * k, 2I']
        act = ops.gated_act(gate_up, self.act_name, self.act)  # [T * k, I']
        out = _GROUPED_MM(act, self.down_t, offs=ends)  # [T * k, hidden]; unwritten past ends[-1]
        out = out * weights[order, None]
        if not self.holds_all_experts:
            out = out.masked_fill((sorted_ids == self.gate_up_t.shape[0]).unsqueeze(1), 0)
        return torch.empty_like(out).index_copy_(0, order, out)  # back in (token, slot) order

    def reference_forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:  # same contract as pairs_forward
        """One matmul pair per picked expert this rank holds; reads the picked set on the host."""
        out = torch.zeros_like(x)
        first, num_held = self.expert_shard.start, self.expert_shard.size
        for expert in torch.unique(experts).tolist():
            if not first <= expert < first + num_held:
                continue
            token_idx, slot = torch.where(experts == expert)
            held = expert - first
            gate_up = F.linear(x[token_idx], self.experts.gate_up_proj[held])  # [n, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.experts.down_proj[held])  # [n, hidden]
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        return out


def moe_syncs_host(model: nn.Module) -> bool:
    """Whether some MoE layer of ``model`` reads device data on the host in its forward (so
    the model's steps cannot be captured in CUDA graphs); logs which layer and why."""
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE) and module.syncs_host:
            weight = module.experts.down_proj
            logger.warning(
                "MoE layer %s syncs with the host on %s %s (torch's grouped GEMM runs without "
                "host reads for bfloat16 on SM 9.x / 10.x only): CUDA graphs off",
                name,
                weight.device,
                weight.dtype,
            )
            return True
    return False
