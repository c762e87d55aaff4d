"""Attention backends, chosen by name from config.

Each backend module is imported only when it is created, so an optional kernel
library (flashinfer) is needed only by the processes that pick it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.engine.attention.base import AttentionBatch, BaseAttentionBackend, ForwardMode


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
    "supported_attention_backends",
]
