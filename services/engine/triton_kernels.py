"""Triton kernels for the decoder's elementwise steps (CUDA only; imported through ``ops``).

Each kernel reproduces the torch reference in ``ops`` with the same bf16 rounding
points, and replaces several launches with one: this matters most in decode, where a
step is hundreds of tiny kernels.

On Hopper and later every kernel here is launched with programmatic dependent launch
(PDL): it may start while the kernel before it on the stream is finishing, does only
what needs no earlier result (lets its own successor launch; the GEMV also loads its
first weight tile), then waits (``griddepcontrol.wait``: the previous grid finished and
its writes are visible) before it reads or writes anything else. Kernels launched without
PDL (torch's) still wait for everything before them, so mixing is safe; in a CUDA graph
the launches become programmatic edges, so a kernel's launch overlaps its predecessor's tail
(docs/benchmarks.md has the measurements).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _pdl_on(device_index: int) -> bool:
    has_gdc = hasattr(tl.extra, "cuda") and hasattr(tl.extra.cuda, "gdc_wait")
    return has_gdc and torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL (Hopper or later, and a Triton with ``gdc_wait``)."""
    return _pdl_on(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _pdl_args(t: torch.Tensor) -> dict:
    """The launch arguments for a kernel with a ``PDL`` constexpr, run on ``t``'s device."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(t) else {"PDL": False}


@triton.jit
def _pdl_begin(PDL: tl.constexpr):
    # let the next kernel launch once all our programs started, then wait for the previous one
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    x_stride,
    res_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    _pdl_begin(PDL)
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
    out = torch.empty(
        (n_rows, n_cols), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
    )
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        summed = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out, summed
    block = triton.next_power_of_2(n_cols)
    res = residual if residual is not None else x
    _rms_norm_kernel[(n_rows,)](
        x,
        res,
        weight,
        out,
        summed if summed is not None else out,
        x.stride(0),
        res.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 8),
        **_pdl_args(x),
    )
    return out, summed


@triton.jit
def _rotary_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    qkv_stride,
    cos_stride,
    sin_stride,
    num_heads,
    k_dst,
    v_dst,
    slot_ptr,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # rotates heads [0, num_heads) of token t in place; STORE_KV: the last num_kv_heads of them (k)
    # and the num_kv_heads heads after them (v) also go to slot slot_ptr[t] of k_dst / v_dst.
    # BLOCK_HALF: HALF rounded up to a power of two (the ViT's head dim 80 has HALF 40)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    offs = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    if BLOCK_HALF == HALF:
        mask = heads < num_heads
    else:
        mask = (heads < num_heads) & (offs < HALF)
    row = qkv_ptr + t * qkv_stride
    _pdl_begin(PDL)
    first = row + heads * (2 * HALF) + offs
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if BLOCK_HALF == HALF:
        c = tl.load(cos_ptr + t * cos_stride + offs).to(tl.float32)
        s = tl.load(sin_ptr + t * sin_stride + offs).to(tl.float32)
    else:
        c = tl.load(cos_ptr + t * cos_stride + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * sin_stride + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    out1 = (x1 * c - x2 * s).to(dtype)
    out2 = (x2 * c + x1 * s).to(dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv_row = num_kv_heads * 2 * HALF
        k_head = heads - (num_heads - num_kv_heads)  # k heads are the last rotated ones
        k_mask = mask & (k_head >= 0)
        k_out = k_dst + slot * kv_row + k_head * (2 * HALF) + offs
        tl.store(k_out, out1, mask=k_mask)
        tl.store(k_out + HALF, out2, mask=k_mask)
        v_heads = tl.arange(0, BLOCK_KV)[:, None]
        v_cols = tl.arange(0, 2 * HALF)[None, :]
        v_mask = v_heads < num_kv_heads
        v = tl.load(row + (num_heads + v_heads) * (2 * HALF) + v_cols, mask=v_mask, other=0.0)
        tl.store(v_dst + slot * kv_row + v_heads * (2 * HALF) + v_cols, v, mask=v_mask)


def rotary_inplace(
    qkv: torch.Tensor,  # [T, >= num_heads * head_dim]; the first num_heads heads are rotated in place
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
    num_heads: int,
    head_dim: int,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | None = None,  # (k_slots, v_slots, slots)
    num_kv_heads: int = 0,  # with kv_store: the last num_kv_heads rotated heads are k, the next ones v
) -> None:
    n = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.shape[0] == n and head_dim % 2 == 0
    half = head_dim // 2
    if kv_store is not None:
        assert half & (half - 1) == 0, (
            f"the fused KV store needs a power-of-two half head dim, got {half}"
        )
        k_slots, v_slots, slots = kv_store
        assert (
            0 < num_kv_heads <= num_heads and qkv.shape[1] >= (num_heads + num_kv_heads) * head_dim
        )
        for dst in (k_slots, v_slots):
            assert (
                dst.is_contiguous()
                and dst.dtype == qkv.dtype
                and dst.shape[1:] == (num_kv_heads, head_dim)
            )
        assert slots.shape == (n,)
    else:
        k_slots = v_slots = slots = qkv  # unused
    if n == 0:
        return
    _rotary_kernel[(n,)](
        qkv,
        cos,
        sin,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        k_slots,
        v_slots,
        slots,
        num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        STORE_KV=kv_store is not None,
        BLOCK_KV=triton.next_power_of_2(max(num_kv_heads, 1)),
        num_warps=4,
        BLOCK_HALF=triton.next_power_of_2(half),
        **_pdl_args(qkv),
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    _pdl_begin(PDL)
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
        gate_up,
        out,
        gate_up.stride(0),
        n_cols,
        BLOCK=block,
        num_warps=4,
        **_pdl_args(gate_up),
    )
    return out


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    n_out,
    k_in,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # y[n] = sum_k w[n, k] * x[k] (+ b[n])
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_out
    w_rows = w_ptr + rows[:, None].to(tl.int64) * k_in
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # the first weight tile (and the bias) need nothing from the previous kernel: load them before waiting
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < k_in
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
    acc = w.to(tl.float32) * x[None, :].to(tl.float32)
    for k0 in range(BLOCK_K, k_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < k_in
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += b
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def _gemv_config(n_out: int, k_in: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an ``[n_out, k_in]`` weight, tuned by shape
    regime; ``python -m benchmarks.gemv`` times them (docs/benchmarks.md).

    Long rows (down projection) want wide K tiles; very wide outputs (gate/up, LM head)
    want software pipelining; narrow outputs (o projection) want many small programs so
    every SM has loads in flight.
    """
    if k_in >= 8192:
        return 16, 1024, 8, 1
    if n_out >= 16384:
        return 8, 512, 4, 3
    if n_out <= 4096:
        return 2, 512, 4, 1
    return 8, 512, 8, 1


def gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K], contiguous
    bias: torch.Tensor | None,  # [N] or None
) -> torch.Tensor:  # [1, N]
    """One-row ``F.linear`` (decode at batch 1) as a bandwidth-bound GEMV: no split-K, bias fused."""
    n_out, k_in = weight.shape
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
    assert x.shape[1] == k_in, (x.shape, weight.shape)
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = _gemv_config(n_out, k_in)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n_out,
        k_in,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **_pdl_args(x),
    )
    return y
