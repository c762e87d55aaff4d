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


def default_attention_backend(devices: Sequence[str], has_flashinfer: bool) -> str:
    """What ``auto`` runs on ``devices`` (every device of the ranks that share one choice):
    flashinfer when each is a CUDA device and flashinfer is importable, else torch."""
    on_cuda = bool(devices) and all(device.startswith("cuda") for device in devices)
    return "flashinfer" if on_cuda and has_flashinfer else "torch"
