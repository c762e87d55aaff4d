"""``--quantization``: how the decoder's dense linears hold their weights, and
``--kv-cache-dtype``: how the KV pool holds K and V (the arithmetic is ``fp8.py``). Kept free of
torch: the command lines read it."""

from __future__ import annotations

from typing import Any

from services.common.settings import flag

NO_QUANTIZATION = "none"
FP8 = "fp8"
QUANTIZATION_CHOICES = (NO_QUANTIZATION, FP8)
QUANTIZATION_HELP = (
    "weights of the decoder's dense linears (q/k/v, o, gate/up, down): none (--dtype) | fp8 "
    "(e4m3 with one scale per output channel, quantized at load from a bf16/fp32 checkpoint; "
    "activations scaled per token; on CUDA it needs SM 8.9+ and bfloat16)"
)

AUTO_KV_CACHE_DTYPE = "auto"
FP8_E4M3 = "fp8_e4m3"
KV_CACHE_DTYPE_CHOICES = (AUTO_KV_CACHE_DTYPE, FP8_E4M3)
KV_CACHE_DTYPE_HELP = (
    "how the KV pool holds K and V: auto (the model's --dtype) | fp8_e4m3 (one byte an element: "
    "each layer's K and V divided by its fp32 scale, the checkpoint's k_scale / v_scale (or "
    "kv_scale) where it carries them, else 1.0, as vLLM without calibrated scales; on CUDA it "
    "needs SM 8.9+). Prefill and decode must use the same: the KV handoff moves raw pages"
)


def quantization_flag() -> Any:
    """The ``--quantization`` field of every config whose ranks load the decoder."""
    return flag(NO_QUANTIZATION, choices=QUANTIZATION_CHOICES, help=QUANTIZATION_HELP)


def kv_cache_dtype_flag() -> Any:
    """The ``--kv-cache-dtype`` field of every config whose ranks hold a KV pool."""
    return flag(AUTO_KV_CACHE_DTYPE, choices=KV_CACHE_DTYPE_CHOICES, help=KV_CACHE_DTYPE_HELP)


def check_quantization(name: str) -> None:
    if name not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unsupported quantization {name!r}; supported: {', '.join(QUANTIZATION_CHOICES)}"
        )
