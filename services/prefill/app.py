"""Wiring of one prefill worker: model, local KV pool, transfer endpoints, rank worker and leader."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.common.kv_transfer import check_embedding_backend, check_kv_backend
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.prefill.config import PrefillConfig
from services.prefill.leader import Encoder, PrefillLeader
from services.prefill.scheduler import PrefillScheduler
from services.prefill.worker import PrefillRankWorker
from services.transfer import create_embedding_receiver, create_kv_sender
from services.transfer.base import BaseKVSender
from services.transfer.embeddings import BaseEmbeddingReceiver, EmbeddingBuffer, EmbeddingRowManager

logger = logging.getLogger(__name__)


def _engine_kwargs(config: PrefillConfig, backend: str) -> dict[str, Any]:
    """Constructor arguments of a transfer endpoint on ``backend``; only Mooncake's advertise a hostname."""
    return {"hostname": config.advertised_hostname} if backend == "mooncake" else {}


def build_kv_sender(config: PrefillConfig) -> BaseKVSender:
    """The KV sender of ``config.kv_backend``; ``ValueError`` for a backend the service cannot run."""
    backend = check_kv_backend(config.kv_transfer_backend, config.transfer_backend, config.device)
    return create_kv_sender(backend, **_engine_kwargs(config, backend))


def build_embedding_receiver(config: PrefillConfig) -> BaseEmbeddingReceiver:
    """The embedding receiver of ``config.transfer_backend``; ``ValueError`` for an unknown one."""
    backend = check_embedding_backend(config.transfer_backend)
    return create_embedding_receiver(backend, **_engine_kwargs(config, backend))


@dataclass
class PrefillApp:
    leader: PrefillLeader
    kv_sender: BaseKVSender
    embedding_receiver: BaseEmbeddingReceiver

    @classmethod
    def build(
        cls,
        config: PrefillConfig,
        *,
        encoder: Encoder | None = None,
        model: Qwen2_5_VLModel | None = None,
        kv_sender: BaseKVSender | None = None,
        embedding_receiver: BaseEmbeddingReceiver | None = None,
    ) -> PrefillApp:
        """Load the language model (unless ``model`` is given) and build every part; blocking.

        ``kv_sender`` defaults to ``config.kv_backend``'s, ``embedding_receiver`` to
        ``config.transfer_backend``'s; an unsupported backend fails before the model loads.
        """
        if kv_sender is None:
            check_kv_backend(config.kv_transfer_backend, config.transfer_backend, config.device)
        if embedding_receiver is None:
            check_embedding_backend(config.transfer_backend)
        if model is None:
            model = load_model(config.model, device=config.device, dtype=config.dtype, components=("language",))
        runner = ModelRunner(
            model, KVCacheConfig(config.num_pages, config.page_size), config.attention_backend,
            cuda_graph_batch_sizes=(),  # EXTEND only: decode graphs would hold a page for nothing
        )
        if kv_sender is None:
            kv_sender = build_kv_sender(config)
        if embedding_receiver is None:
            embedding_receiver = build_embedding_receiver(config)
        buffer_device = embedding_receiver.buffer_device(runner.device)
        buffer = EmbeddingBuffer(
            config.embedding_rows, model.config.text.hidden_size, runner.dtype, buffer_device,
            pin_memory=buffer_device.type == "cpu" and runner.device.type == "cuda",
        )
        embedding_receiver.register(buffer)
        scheduler = PrefillScheduler(
            EmbeddingRowManager(config.embedding_rows), config.num_pages, config.page_size,
            config.max_batch_tokens, config.max_queued_requests, config.embedding_quarantine_s,
        )
        worker = PrefillRankWorker(runner, kv_sender, buffer)
        leader = PrefillLeader(scheduler, worker, embedding_receiver, encoder, watchdog_s=config.watchdog_s)
        return cls(leader, kv_sender, embedding_receiver)

    async def start(self) -> None:
        await self.leader.start()

    async def close(self) -> None:
        """Stop the leader (failing live requests), then release the transfer endpoints."""
        await self.leader.stop()
        self.kv_sender.close()
        self.embedding_receiver.close()
