"""Triton grouped GEMM of the MoE layer, with the token gather and the routing weight fused in
(CUDA only; ``SparseMoE`` imports it through ``ops.moe_kernels``).

The layout is vLLM's ``fused_moe``: the (token, slot) pairs, sorted by expert, are laid out in
blocks of ``block_m`` slots, each expert's pairs padded to a whole number of blocks, so every
block belongs to one expert (``moe.block_layout`` builds it on the device). A program computes
one ``[block_m, block_n]`` tile: it loads its block's rows of ``a`` by pair (the first GEMM
reads token ``pair // top_k`` of the hidden states, so the ``[T * k, hidden]`` gathered copy is
never written), runs the K loop against its expert's weights, optionally multiplies each row by
its pair's routing weight, and stores the rows at their pair index: the output is in (token,
slot) order, so the combine is one ``view(T, k, H)`` sum with no scatter.

Every shape depends on T, k and ``block_m`` only and nothing is read on the host, so the layer
captures in a CUDA graph on any GPU and dtype Triton runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# By the number of (token, slot) pairs: few pairs spread over many experts need short blocks (a
# padded block computes its zero rows too), many pairs tall ones. From
# `python -m benchmarks.moe_layer --sweep` on an H100 at the 30B-A3B dims (docs/benchmarks.md, "MoE
# layer"): the fastest tile at 64 tokens (512 pairs), 256 (2,048) and 8,192 (65,536); the
# 16,384-pair bound between the last two is not measured.
_CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (512, TileConfig(16, 64, 128, 1, 4, 4)),
    (4096, TileConfig(32, 64, 128, 8, 4, 4)),
    (16384, TileConfig(64, 128, 64, 8, 8, 4)),
    (1 << 62, TileConfig(128, 256, 64, 8, 8, 3)),
)


def tile_config(num_pairs: int) -> TileConfig:
    return next(config for bound, config in _CONFIGS if num_pairs <= bound)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows of a, K]
    b_ptr,  # [E, K, N] (any strides)
    c_ptr,  # [P, N]
    weight_ptr,  # [P] routing weights (read when MUL_WEIGHT)
    pair_ptr,  # [S] int32 pair of each slot (num_pairs: padding)
    block_expert_ptr,  # [S / BLOCK_M] int32 (-1: no expert)
    num_pairs,
    N,
    K,
    num_blocks_m,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,  # a's row of a pair: pair // A_ROW_DIV
    MUL_WEIGHT: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_blocks_n
    first_m = (pid // group_size) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_rows
    pid_n = (pid % group_size) // group_rows
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + offs_m).to(tl.int64)
    row_ok = pairs < num_pairs
    a_rows = pairs // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (
        b_ptr
        + expert.to(tl.int64) * stride_be
        + offs_k[:, None] * stride_bk
        + offs_n[None, :] * stride_bn
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_left = K - k_start
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if FP32_IEEE:  # fp32 weights: full fp32 products, as torch's matmul (no TF32)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    dtype = c_ptr.dtype.element_ty
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) * w[:, None]  # the torch path's rounding points
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(dtype), mask=row_ok[:, None] & (offs_n[None, :] < N))


def moe_gemm(
    a: torch.Tensor,  # [rows, K]: hidden states (a_row_div = top_k) or pair rows (1)
    b: torch.Tensor,  # [E, K, N] this rank's experts
    out: torch.Tensor,  # [P, N], written at each pair's row
    pair_of_slot: torch.Tensor,
    block_expert: torch.Tensor,
    config: TileConfig,
    *,
    a_row_div: int,
    weights: torch.Tensor | None = None,  # [P] routing weight of each pair
) -> torch.Tensor:
    """``out[p] = a[p // a_row_div] @ b[expert of p]`` (times ``weights[p]`` when given) for
    every pair in the layout; rows of pairs in no block (another rank's experts) are left as
    they are."""
    assert a.stride(1) == 1 and out.stride(1) == 1 and a.dtype == b.dtype == out.dtype
    num_pairs, n = out.shape
    k = a.shape[1]
    num_blocks_m = block_expert.numel()
    if num_pairs == 0:
        return out
    grid = (num_blocks_m * triton.cdiv(n, config.block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        pair_of_slot,
        block_expert,
        num_pairs,
        n,
        k,
        num_blocks_m,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=weights is not None,
        FP32_IEEE=a.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
