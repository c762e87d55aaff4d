"""What a service runs on a GPU when its command line does not say: the attention backend
and the share of the device's memory a KV pool sizes itself to. Kept free of torch: the
command lines read it."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence

AUTO_ATTENTION = "auto"  # flashinfer on CUDA devices when importable, else torch
ATTENTION_CHOICES = (AUTO_ATTENTION, "flashinfer", "torch")
ATTENTION_HELP = (
    "torch | flashinfer | auto (flashinfer on a CUDA device when it is installed, else torch)"
)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85


def memory_fraction(text: str) -> float:
    """An argparse ``type``: a share of a device's memory, in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def flashinfer_importable() -> bool:
    """Whether flashinfer can be imported here (looked up, not imported)."""
    return importlib.util.find_spec("flashinfer") is not None


FLASHINFER_DTYPES = ("bfloat16", "float16")  # the KV dtypes its kernels are built for
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes its paged prefill kernels are built for


def default_attention_backend(
    devices: Sequence[str], has_flashinfer: bool, dtype: str = "bfloat16", head_dim: int = 128
) -> str:
    """What ``auto`` runs on ``devices`` (every device of the ranks that share one choice) for a
    model in ``dtype``: flashinfer when each is a CUDA device, flashinfer is importable and
    ``dtype`` and ``head_dim`` are ones it runs, else torch."""
    on_cuda = bool(devices) and all(device.startswith("cuda") for device in devices)
    kernels = dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS
    usable = on_cuda and has_flashinfer and kernels
    return "flashinfer" if usable else "torch"
