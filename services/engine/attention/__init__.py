"""Attention backends, chosen by name from config.

Each backend module is imported only when it is created, so an optional kernel
library (flashinfer) is needed only by the processes that pick it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.engine.attention.base import AttentionBatch, BaseAttentionBackend, ForwardMode
from services.engine.gpu_defaults import (
    AUTO_ATTENTION,
    default_attention_backend,
    flashinfer_importable,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _create_torch(**kwargs: Any) -> BaseAttentionBackend:
    from services.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(**kwargs)


def _create_flashinfer(**kwargs: Any) -> BaseAttentionBackend:
    from services.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(**kwargs)


_BACKEND_FACTORIES: dict[str, Callable[..., BaseAttentionBackend]] = {
    "torch": _create_torch,
    "flashinfer": _create_flashinfer,
}


def supported_attention_backends() -> list[str]:
    return sorted(_BACKEND_FACTORIES)


def resolve_attention_backend(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None, head_dim: int = 128
) -> str:
    """The backend ``name`` (``auto``: ``default_attention_backend``) runs on ``device``;
    ``auto`` that falls back to torch on CUDA says so in the log."""
    if name != AUTO_ATTENTION:
        return name
    dtype_name = "bfloat16" if dtype is None else str(dtype).removeprefix("torch.")
    chosen = default_attention_backend(
        (str(device),), flashinfer_importable(), dtype_name, head_dim
    )
    if chosen == "torch" and str(device).startswith("cuda"):
        logger.warning(
            "attention: torch on %s (flashinfer needs the `gpu` extra installed and a model "
            "in bfloat16 or float16 with a head size of 64, 128 or 256; this one: %s, %d)",
            device,
            dtype_name,
            head_dim,
        )
    return chosen


def create_attention_backend(name: str, **kwargs: Any) -> BaseAttentionBackend:
    """Build the backend registered as ``name`` with ``kwargs``; ``ValueError`` for an unknown name."""
    factory = _BACKEND_FACTORIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown attention backend {name!r}; supported: {', '.join(supported_attention_backends())}"
        )
    return factory(**kwargs)


__all__ = [
    "AttentionBatch",
    "BaseAttentionBackend",
    "ForwardMode",
    "create_attention_backend",
    "resolve_attention_backend",
    "supported_attention_backends",
]
