"""Triton kernels that move KV pages and slots (CUDA only; imported through ``ops``): a
token's K and V into its slots, and whole pages between two pools (a peer GPU's mapped in)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    k_dst,
    v_dst,
    k_stride,
    v_stride,
    row_size,
    k_scale_ptr,
    v_scale_ptr,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < row_size
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + t * v_stride + cols, mask=mask)
    if QUANTIZE:  # fp8.quantize_scaled: value / scale, clamped to +-FP8_MAX, rounded to e4m3
        k = tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))
        v = tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX).to(k_dst.dtype.element_ty)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX).to(v_dst.dtype.element_ty)
    tl.store(k_dst + slot * row_size + cols, k, mask=mask)
    tl.store(v_dst + slot * row_size + cols, v, mask=mask)


def store_kv(
    k_slots: torch.Tensor,  # [num_slots, Hkv, D], contiguous (one layer of the pool)
    v_slots: torch.Tensor,
    slots: torch.Tensor,  # [T] int
    k: torch.Tensor,  # [T, Hkv, D]; each token's heads contiguous (a view of qkv is fine)
    v: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # e4m3 slots: ops.store_kv
) -> None:
    """K and V of every token to its slot in one launch (two ``index_copy_`` otherwise), scaled
    and rounded to e4m3 in the kernel with ``scales``."""
    n = k.shape[0]
    row_size = k.shape[1] * k.shape[2]
    assert k_slots.is_contiguous() and v_slots.is_contiguous() and k_slots.shape[1:] == k.shape[1:]
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == t.shape[2]
        assert t.dtype == k_slots.dtype or (scales is not None and k_slots.dtype == FP8_DTYPE)
    if n == 0:
        return
    k_scale, v_scale = scales if scales is not None else (k_slots, v_slots)  # unused without
    _store_kv_kernel[(n,)](
        k,
        v,
        slots,
        k_slots,
        v_slots,
        k.stride(0),
        v.stride(0),
        row_size,
        k_scale,
        v_scale,
        QUANTIZE=scales is not None,
        FP8_MAX=FP8_MAX,
        BLOCK=triton.next_power_of_2(row_size),
        num_warps=4,
    )


@triton.jit
def _copy_pages_kernel(
    src_k,
    src_v,
    dst_k,
    dst_v,
    src_pages,
    dst_pages,
    src_layer_stride,
    dst_layer_stride,
    PAGE_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per (request page, layer, K or V): PAGE_NUMEL contiguous elements
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src_off = layer * src_layer_stride + tl.load(src_pages + i).to(tl.int64) * PAGE_NUMEL
    dst_off = layer * dst_layer_stride + tl.load(dst_pages + i).to(tl.int64) * PAGE_NUMEL
    # BLOCK divides PAGE_NUMEL: no mask, wide accesses
    for start in tl.static_range(0, PAGE_NUMEL, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if tl.program_id(2) == 0:
            tl.store(dst_k + dst_off + offs, tl.load(src_k + src_off + offs))
        else:
            tl.store(dst_v + dst_off + offs, tl.load(src_v + src_off + offs))


def copy_pages(
    src_k: torch.Tensor,  # [L, P_src, S, H, D] (a KV pool's buffers)
    src_v: torch.Tensor,
    src_pages: torch.Tensor,  # [n] int32, on the source device or pinned host memory
    dst_k: torch.Tensor,  # [L, P_dst, S, H, D]; may be another GPU's memory mapped here
    dst_v: torch.Tensor,
    dst_pages: torch.Tensor,  # [n] int
) -> None:
    """Page ``src_pages[i]`` of every layer of K and V to ``dst_pages[i]``: one launch, no
    staging."""
    num_layers, n = src_k.shape[0], src_pages.shape[0]
    page_numel = src_k.stride(1)  # contiguous [L, P, S, H, D]: one page of one layer
    # shape arithmetic only: this runs once per request on the host
    for t in (src_k, src_v, dst_k, dst_v):
        assert t.is_contiguous() and t.shape[0] == num_layers and t.stride(1) == page_numel
    if n == 0:
        return
    _copy_pages_kernel[(n, num_layers, 2)](
        src_k,
        src_v,
        dst_k,
        dst_v,
        src_pages,
        dst_pages,
        src_k.stride(0),
        dst_k.stride(0),
        PAGE_NUMEL=page_numel,
        BLOCK=min(2048, page_numel & -page_numel),  # largest 2^k dividing it
        num_warps=4,
    )
