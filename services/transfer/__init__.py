"""KV transfer backends, chosen by name from config.

Each backend module is imported only when it is created, so an optional engine
(Mooncake) is needed only by the processes that pick it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    KvPoolLayout,
    TransferPlan,
    TransferResult,
)
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingDestination,
)


def _factory(module: str, cls: str) -> Callable[..., Any]:
    def create(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"services.transfer.{module}"), cls)(**kwargs)

    return create


# "cuda_ipc" (GPUs of one host, peers) and "shm" (host memory shared by the processes of one
# host, through /dev/shm) need nothing; "inprocess" works inside one process only.
_SENDER_FACTORIES: dict[str, Callable[..., BaseKVSender]] = {
    "mooncake": _factory("mooncake_backend", "MooncakeKVSender"),
    "inprocess": _factory("inprocess_backend", "InProcessKVSender"),
    "cuda_ipc": _factory("cuda_ipc_backend", "CudaIpcKVSender"),
    "shm": _factory("shm_backend", "ShmKVSender"),
}
_RECEIVER_FACTORIES: dict[str, Callable[..., BaseKVReceiver]] = {
    "mooncake": _factory("mooncake_backend", "MooncakeKVReceiver"),
    "inprocess": _factory("inprocess_backend", "InProcessKVReceiver"),
    "cuda_ipc": _factory("cuda_ipc_backend", "CudaIpcKVReceiver"),
    "shm": _factory("shm_backend", "ShmKVReceiver"),
}


# Embedding rows (vision encoder -> prefill), same backend names as the KV handoff.
_EMBEDDING_SENDER_FACTORIES: dict[str, Callable[..., BaseEmbeddingSender]] = {
    "mooncake": _factory("embeddings_mooncake", "MooncakeEmbeddingSender"),
    "inprocess": _factory("embeddings_inprocess", "InProcessEmbeddingSender"),
    "shm": _factory("embeddings_shm", "ShmEmbeddingSender"),
    "cuda_ipc": _factory("embeddings_cuda_ipc", "CudaIpcEmbeddingSender"),
}
_EMBEDDING_RECEIVER_FACTORIES: dict[str, Callable[..., BaseEmbeddingReceiver]] = {
    "mooncake": _factory("embeddings_mooncake", "MooncakeEmbeddingReceiver"),
    "inprocess": _factory("embeddings_inprocess", "InProcessEmbeddingReceiver"),
    "shm": _factory("embeddings_shm", "ShmEmbeddingReceiver"),
    "cuda_ipc": _factory("embeddings_cuda_ipc", "CudaIpcEmbeddingReceiver"),
}


def create_embedding_sender(name: str, **kwargs: Any) -> BaseEmbeddingSender:
    """The encoder-side embedding sender registered as ``name``; ``ValueError`` if unknown."""
    return _lookup(_EMBEDDING_SENDER_FACTORIES, name)(**kwargs)


def create_embedding_receiver(name: str, **kwargs: Any) -> BaseEmbeddingReceiver:
    """The prefill-side embedding receiver registered as ``name``; ``ValueError`` if unknown."""
    return _lookup(_EMBEDDING_RECEIVER_FACTORIES, name)(**kwargs)


def supported_transfer_backends() -> list[str]:
    return sorted(_SENDER_FACTORIES)


def create_kv_sender(name: str, **kwargs: Any) -> BaseKVSender:
    """Build the prefill-side sender registered as ``name``; ``ValueError`` for an unknown name."""
    return _lookup(_SENDER_FACTORIES, name)(**kwargs)


def create_kv_receiver(name: str, **kwargs: Any) -> BaseKVReceiver:
    """Build the decode-side receiver registered as ``name``; ``ValueError`` for an unknown name."""
    return _lookup(_RECEIVER_FACTORIES, name)(**kwargs)


def _lookup(factories: dict[str, Callable[..., Any]], name: str) -> Callable[..., Any]:
    factory = factories.get(name)
    if factory is None:
        raise ValueError(
            f"unknown KV transfer backend {name!r}; "
            f"supported: {', '.join(supported_transfer_backends())}"
        )
    return factory


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
    "create_embedding_receiver",
    "create_embedding_sender",
    "create_kv_receiver",
    "create_kv_sender",
    "supported_transfer_backends",
]
