"""FP8 (e4m3) weights with per-output-channel scales and per-token activation scales, and the
per-layer scaling of an FP8 KV pool (``quantize_scaled``, ``kv_cache.KVPool``).

A weight ``[out, in]`` is held as ``float8_e4m3fn`` with one fp32 scale per output row,
``scale = max|row| / 448`` (448: e4m3's largest value), so ``q * scale`` restores the row to
e4m3's 3-bit mantissa. A linear quantizes its input the same way per row (token) at run time
and computes ``(x_q @ w_q.T) * x_scale * w_scale`` accumulated in fp32: on CUDA one
``torch._scaled_mm`` with row-wise scales (Hopper / Ada FP8 tensor cores, bf16 out), elsewhere
the torch reference below, which dequantizes to fp32 and multiplies (the same arithmetic up to
the accumulation order).
"""

from __future__ import annotations

import torch

from services.common.errors import ModelLoadError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_AMAX = 1e-12  # a row whose largest magnitude is below this (all zeros) gets this one's scale
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
ALIGNMENT = 16  # _scaled_mm: K and N multiples of 16 on CUDA


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [rows, cols] as e4m3 [rows, cols] and fp32 scales [rows, 1], one per row, with
    ``q * scale`` within e4m3's rounding of ``t`` (the row's largest magnitude maps to 448)."""
    t32 = t.float()
    scale = t32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    q = (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` for e4m3 ``q`` [rows, cols] and scales [rows] or [rows, 1]."""
    return q.float() * scale.reshape(-1, 1)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's weight [out, in] as e4m3 [out, in] and fp32 scales [out] (per output
    channel); ``ModelLoadError`` for a CUDA weight ``_scaled_mm`` cannot take."""
    if weight.is_cuda and (weight.shape[0] % ALIGNMENT or weight.shape[1] % ALIGNMENT):
        raise ModelLoadError(
            f"an FP8 weight of shape {tuple(weight.shape)}: torch._scaled_mm needs both dims "
            f"multiples of {ALIGNMENT} (give --quantization none)"
        )
    q, scale = quantize_rows(weight.detach())
    return q, scale.view(-1)


def linear(
    x: torch.Tensor,  # [T, in] bf16 (CUDA) or any float dtype (CPU)
    weight: torch.Tensor,  # [out, in] e4m3
    weight_scale: torch.Tensor,  # [out] fp32
    bias: torch.Tensor | None = None,  # [out], x's dtype
) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per token; [T, out] in
    ``x``'s dtype."""
    assert x.dim() == 2 and weight.dtype == FP8_DTYPE, (x.shape, weight.dtype)
    x_q, x_scale = quantize_rows(x)  # [T, in] e4m3, [T, 1] fp32
    if x.is_cuda:
        out = torch._scaled_mm(
            x_q, weight.t(), x_scale, weight_scale.view(1, -1), out_dtype=x.dtype
        )
    else:
        out = ((x_q.float() @ weight.float().t()) * x_scale * weight_scale).to(x.dtype)
    return out if bias is None else out + bias


def quantize_scaled(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` in fp32, clamped to e4m3's range (+-448) and rounded to e4m3; ``scale`` one
    fp32 value (a 0-dim tensor): how an FP8 KV pool stores K or V."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_scaled(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` for e4m3 ``q`` and one fp32 ``scale``: K or V read from an FP8 pool."""
    return q.float() * scale


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """``ValueError`` naming why ``device`` cannot run FP8 linears in ``dtype``."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"--quantization fp8 runs on CUDA or the CPU, not on {device}")
    _check_capability(device, "--quantization fp8", "FP8 tensor cores", "--quantization none")
    if dtype != torch.bfloat16:
        raise ValueError(
            "--quantization fp8 on CUDA needs --dtype bfloat16 (torch._scaled_mm's row-wise "
            f"scales write bf16); the model is {dtype}"
        )


def check_fp8_kv_device(device: torch.device) -> None:
    """``ValueError`` naming why ``device`` cannot hold an FP8 KV pool."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"--kv-cache-dtype fp8_e4m3 runs on CUDA or the CPU, not on {device}")
    _check_capability(
        device,
        "--kv-cache-dtype fp8_e4m3",
        "e4m3 conversions in its Triton KV store",
        "--kv-cache-dtype auto",
    )


def _check_capability(device: torch.device, what: str, needs: str, instead: str) -> None:
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"{what} needs {needs} (SM {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: Ada, Hopper or "
            f"newer); {torch.cuda.get_device_name(device)} is SM {capability[0]}.{capability[1]} "
            f"(give {instead})"
        )
