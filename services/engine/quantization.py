"""``--quantization``: how the decoder's dense linears hold their weights (the arithmetic is
``fp8.py``). Kept free of torch: the command lines read it."""

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


def quantization_flag() -> Any:
    """The ``--quantization`` field of every config whose ranks load the decoder."""
    return flag(NO_QUANTIZATION, choices=QUANTIZATION_CHOICES, help=QUANTIZATION_HELP)


def check_quantization(name: str) -> None:
    if name not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unsupported quantization {name!r}; supported: {', '.join(QUANTIZATION_CHOICES)}"
        )
