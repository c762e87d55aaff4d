"""Elementwise steps of the decoder (and its one-row matmuls), fused on CUDA and plain torch elsewhere.

Each function has one torch definition (the reference, used on CPU); on a CUDA tensor
it runs one Triton kernel instead, with the same rounding points in bf16. Triton is
imported on first CUDA use only, so CPU processes never need it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType

import torch

from services.engine import fp8
from services.engine.model.rope import apply_rotary, rotate_half


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"services.engine.{name}")
    except ImportError:  # no triton in this environment: the torch definitions run
        return None


def _fused(x: torch.Tensor, module: str = "triton_kernels") -> ModuleType | None:
    return _triton_module(module) if x.is_cuda else None


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for this thread while a model runs: Triton launches on the current
    device (each thread has its own, cuda:0 by default), so a model on cuda:1 driven from a worker
    thread would otherwise launch on GPU 0 with GPU 1's pointers."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def moe_kernels(x: torch.Tensor) -> ModuleType | None:
    """The MoE layer's Triton GEMMs (``triton_moe``) for a CUDA ``x``; None elsewhere."""
    return _fused(x, "triton_moe")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dim, normalized in fp32; x [T, H] -> [T, H]."""
    kernels = _fused(x)
    if kernels is not None and x.dim() == 2:
        return kernels.rms_norm(x, weight, eps, None)[0]
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; x, residual [T, H]."""
    kernels = _fused(x)
    if kernels is not None and x.dim() == 2:
        out, summed = kernels.rms_norm(x, weight, eps, residual)
        assert summed is not None
        return out, summed
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_qk(
    qkv: torch.Tensor,  # [T, (Hq + 2 * Hkv) * D], q heads then k heads then v heads
    cos: torch.Tensor,  # [T, D], both halves equal
    sin: torch.Tensor,  # [T, D]
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | None = None,  # (k_slots, v_slots, slots)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary applied to the q and k heads; returns q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D].

    With ``kv_store``, the rotated k and v of token i are also stored at ``slots[i]`` of the
    pool layer ``(k_slots, v_slots)`` (``[num_slots, Hkv, D]`` each). On CUDA the rotation
    is done in place in ``qkv`` (q/k/v are views of it) and the store is part of the same kernel.
    """
    assert kv_store is None or kv_store[0].dtype != fp8.FP8_DTYPE, "KVPool.write stores FP8 pages"
    n = qkv.shape[0]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    kernels = _fused(qkv)
    if kernels is not None:
        fused_store = kv_store is not None and kv_store[0].dtype == qkv.dtype
        kernels.rotary_inplace(
            qkv,
            cos,
            sin,
            num_q_heads + num_kv_heads,
            head_dim,
            kv_store if fused_store else None,
            num_kv_heads,
        )
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = (
            q.view(n, num_q_heads, head_dim),
            k.view(n, num_kv_heads, head_dim),
            v.view(n, num_kv_heads, head_dim),
        )
        if kv_store is not None and not fused_store:
            k_slots, v_slots, slots = kv_store
            store_kv(k_slots, v_slots, slots, k.to(k_slots.dtype), v.to(v_slots.dtype))
        return q, k, v
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(n, num_q_heads, head_dim)
    k = apply_rotary(k.reshape(n, num_kv_heads, head_dim), cos, sin)
    v = v.reshape(n, num_kv_heads, head_dim)
    if kv_store is not None:
        k_slots, v_slots, slots = kv_store
        store_kv(k_slots, v_slots, slots.long(), k.to(k_slots.dtype), v.to(v_slots.dtype))
    return apply_rotary(q, cos, sin), k, v


def rotary_qk_fp32(
    qkv: torch.Tensor,  # [T, 3 * H * D]: q heads, k heads, v heads (the ViT's qkv projection)
    cos: torch.Tensor,  # [T, D] fp32, both halves equal
    sin: torch.Tensor,  # [T, D] fp32
    num_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary of q and k computed in fp32 and rounded once; returns q, k, v [T, H, D] (views of qkv on CUDA,
    where the rotation is one in-place kernel instead of a dozen elementwise ones)."""
    n = qkv.shape[0]
    kernels = _fused(qkv)
    if kernels is not None and qkv.stride(1) == 1:
        kernels.rotary_inplace(qkv, cos, sin, 2 * num_heads, head_dim)
        q, k, v = qkv.view(n, 3, num_heads, head_dim).unbind(1)
        return q, k, v
    q, k, v = qkv.view(n, 3, num_heads, head_dim).unbind(1)
    dtype, cos, sin = q.dtype, cos[:, None, :], sin[:, None, :]
    q = (q.float() * cos + rotate_half(q.float()) * sin).to(dtype)
    k = (k.float() * cos + rotate_half(k.float()) * sin).to(dtype)
    return q, k, v


def gated_act(gate_up: torch.Tensor, act_name: str, act) -> torch.Tensor:
    """``act(gate) * up`` for gate_up [T, 2I] (gate first); returns [T, I]."""
    kernels = _fused(gate_up)
    if kernels is not None and act_name == "silu" and gate_up.dim() == 2:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def _gemv_kernels(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The Triton module when ``x @ weight.T`` is one bf16/fp16 CUDA row (decode at batch 1)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if weight.dtype != x.dtype or not weight.is_contiguous() or not x.is_contiguous():
        return None
    return _fused(x)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``; a single CUDA row runs as one GEMV kernel (cuBLAS splits K there and reduces
    apart). With ``weight_scale`` [out] the weight is FP8 and ``x`` is quantized per token
    (``fp8.linear``)."""
    if weight_scale is not None:
        return fp8.linear(x, weight, weight_scale, bias)
    kernels = _gemv_kernels(x, weight)
    if kernels is not None:
        return kernels.gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def gated_linear(
    gate_up: torch.Tensor,
    act_name: str,
    act,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(gated_act(gate_up), weight, bias, weight_scale)``. The activation stays its own
    kernel: fused into either GEMV it was no faster (``docs/benchmarks.md``, "Measurements cited
    by the code")."""
    return linear(gated_act(gate_up, act_name, act), weight, bias, weight_scale)


def store_kv(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``k_slots[slots[i]] = k[i]`` and the same for v; slots/k/v on the pool's device and dtype.

    With ``scales`` (K's and V's, one fp32 each, 0-dim on the pool's device) the slots are
    e4m3 and ``k``/``v`` (the model's dtype) are stored as ``fp8.quantize_scaled`` of them."""
    kernels = _fused(k, "triton_kv")
    if (
        kernels is not None
        and k.stride(2) == 1
        and v.stride(2) == 1
        and k.stride(1) == v.stride(1) == k.shape[2]
    ):
        kernels.store_kv(k_slots, v_slots, slots, k, v, scales)
        return
    if scales is not None:  # no index_copy_ for e4m3: its bytes move as uint8
        k_slots, v_slots = k_slots.view(torch.uint8), v_slots.view(torch.uint8)
        k = fp8.quantize_scaled(k, scales[0]).view(torch.uint8)
        v = fp8.quantize_scaled(v, scales[1]).view(torch.uint8)
    k_slots.index_copy_(0, slots, k)
    v_slots.index_copy_(0, slots, v)


def copy_pages(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    src_pages: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    """Pool pages ``src_pages[i]`` -> ``dst_pages[i]`` for every layer of K and V (buffers ``[L, P, S, H, D]``)."""
    kernels = _fused(src_k, "triton_kv")
    if kernels is not None:
        kernels.copy_pages(src_k, src_v, src_pages, dst_k, dst_v, dst_pages)
        return
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        dst.index_copy_(1, dst_pages.long(), src.index_select(1, src_pages.long()))
