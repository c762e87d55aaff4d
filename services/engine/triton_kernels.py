"""Triton kernels for the decoder's elementwise steps (CUDA only; imported through ``ops``).

Each kernel reproduces the torch reference in ``ops`` with the same bf16 rounding
points, and replaces several launches with one: this matters most in decode, where a
step is hundreds of tiny kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    x_stride, res_stride, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None,  # [T, H] or None
) -> tuple[torch.Tensor, torch.Tensor | None]:  # normed [T, H], x + residual [T, H] (or None)
    n_rows, n_cols = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((n_rows, n_cols), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        summed = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out, summed
    block = triton.next_power_of_2(n_cols)
    res = residual if residual is not None else x
    _rms_norm_kernel[(n_rows,)](
        x, res, weight, out, summed if summed is not None else out,
        x.stride(0), res.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 8),
    )
    return out, summed


@triton.jit
def _rotary_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qkv_stride, cos_stride, sin_stride, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    offs = tl.arange(0, HALF)[None, :]  # [1, HALF]
    mask = heads < num_heads
    first = qkv_ptr + t * qkv_stride + heads * (2 * HALF) + offs
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * cos_stride + offs).to(tl.float32)
    s = tl.load(sin_ptr + t * sin_stride + offs).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    tl.store(first, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


def rotary_inplace(
    qkv: torch.Tensor,  # [T, >= num_heads * head_dim]; the first num_heads heads are rotated in place
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
    num_heads: int,
    head_dim: int,
) -> None:
    n = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.shape[0] == n and head_dim % 2 == 0
    half = head_dim // 2
    assert half & (half - 1) == 0, f"rotary kernel needs a power-of-two half head dim, got {half}"
    if n == 0:
        return
    _rotary_kernel[(n,)](
        qkv, cos, sin, qkv.stride(0), cos.stride(0), sin.stride(0), num_heads,
        HALF=half, BLOCK_H=triton.next_power_of_2(num_heads), num_warps=4,
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    n_rows, width = gate_up.shape
    assert gate_up.stride(1) == 1 and width % 2 == 0
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows == 0:
        return out
    block = 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
        gate_up, out, gate_up.stride(0), n_cols, BLOCK=block, num_warps=4
    )
    return out
