"""Transfer backends, created by name (or ``TransferSpec``) from ``services.common.kv_transfer``'s
registry.

Each backend module is imported only when it is created, so an optional engine
(Mooncake) is needed only by the processes that pick it.
"""

from __future__ import annotations

import importlib
from typing import Any

from services.common.destinations import EmbeddingDestination, KvDestination, KvPoolLayout
from services.common.kv_transfer import TransferSpec, lookup_backend
from services.transfer.base import BaseKVReceiver, BaseKVSender, TransferPlan, TransferResult
from services.transfer.embeddings import BaseEmbeddingReceiver, BaseEmbeddingSender


def _create(spec: str | TransferSpec, role: str, family: str, kwargs: dict[str, Any]) -> Any:
    """``role`` of the backend ``spec`` names, built with the spec's kwargs, then ``kwargs``."""
    spec = TransferSpec(spec) if isinstance(spec, str) else spec
    backend = lookup_backend(spec.backend, family)
    module, cls = getattr(backend, role).split(":")
    factory = getattr(importlib.import_module(f"services.transfer.{module}"), cls)
    return factory(**{**backend.kwargs(spec, role), **kwargs})


def create_kv_sender(spec: str | TransferSpec, **kwargs: Any) -> BaseKVSender:
    """The prefill-side sender of ``spec`` (a backend name, or a spec naming one); ``ValueError``
    for an unknown name."""
    return _create(spec, "kv_sender", "KV", kwargs)


def create_kv_receiver(spec: str | TransferSpec, **kwargs: Any) -> BaseKVReceiver:
    """The decode-side receiver of ``spec``; ``ValueError`` for an unknown name."""
    return _create(spec, "kv_receiver", "KV", kwargs)


def create_embedding_sender(spec: str | TransferSpec, **kwargs: Any) -> BaseEmbeddingSender:
    """The encoder-side embedding sender of ``spec``; ``ValueError`` for an unknown name."""
    return _create(spec, "embedding_sender", "embedding", kwargs)


def create_embedding_receiver(spec: str | TransferSpec, **kwargs: Any) -> BaseEmbeddingReceiver:
    """The prefill-side embedding receiver of ``spec``; ``ValueError`` for an unknown name."""
    return _create(spec, "embedding_receiver", "embedding", kwargs)


__all__ = [
    "BaseKVReceiver",
    "BaseKVSender",
    "KvDestination",
    "KvPoolLayout",
    "TransferPlan",
    "TransferResult",
    "BaseEmbeddingReceiver",
    "BaseEmbeddingSender",
    "EmbeddingDestination",
    "TransferSpec",
    "create_embedding_receiver",
    "create_embedding_sender",
    "create_kv_receiver",
    "create_kv_sender",
]
