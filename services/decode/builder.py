"""Build one decode rank from config: language model, model runner and KV pool, receiver, engine."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from services.common.kv_transfer import check_kv_backend
from services.decode.config import DecodeConfig
from services.decode.engine import DecodeEngine
from services.decode.kv_manager import KVReservationManager
from services.decode.scheduler import DecodeScheduler
from services.decode.worker import DecodeWorker
from services.engine.config import ModelConfig
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.sampler import Sampler
from services.transfer import BaseKVReceiver, create_kv_receiver
from services.transfer.base import Clock


def eos_token_ids(model_dir: Path, config: ModelConfig) -> frozenset[int]:
    """The model's EOS ids: config.json's plus generation_config.json's (as ``transformers`` stops)."""
    ids = set(config.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(token_id) for token_id in eos)
    return frozenset(ids)


def create_receiver(config: DecodeConfig, **kwargs: Any) -> BaseKVReceiver:
    """The KV receiver of ``config.kv_backend``; ``ValueError`` for a backend the service cannot run."""
    backend = check_kv_backend(config.kv_transfer_backend, config.transfer_backend, config.device)
    if backend == "mooncake":
        kwargs.setdefault("hostname", config.transfer_host or config.host)
    return create_kv_receiver(backend, **kwargs)


def build_engine(
    config: DecodeConfig,
    model: Qwen2_5_VLModel | None = None,
    receiver: BaseKVReceiver | None = None,
    quarantine_clock: Clock = time.monotonic,
) -> DecodeEngine:
    """A decode engine (not started) whose KV pool is registered with ``receiver`` once.

    ``model``: an already loaded language model to share (tests); ``receiver``: one built
    by the caller (tests pass an in-process one on their own fabric); ``quarantine_clock``:
    when quarantined KV pages are due back (tests move it forward). Without ``receiver``,
    an unsupported KV backend fails before the model loads.
    """
    if receiver is None:
        check_kv_backend(config.kv_transfer_backend, config.transfer_backend, config.device)
    if model is None:
        model = load_model(config.model, device=config.device, dtype=config.dtype, components=("language",))
    runner = ModelRunner(model, KVCacheConfig(config.num_pages, config.page_size), config.attention_backend)
    receiver = receiver if receiver is not None else create_receiver(config)
    receiver.register(runner.kv_pool)
    text = model.config.text
    eos_ids = eos_token_ids(config.model, model.config)
    scheduler = DecodeScheduler(
        KVReservationManager(runner.page_table, config.kv_quarantine_s, quarantine_clock),
        eos_ids,
        config.max_model_len or text.max_position_embeddings,
        config.max_running_requests,
    )
    return DecodeEngine(
        scheduler, DecodeWorker(runner, Sampler(eos_ids)), receiver,
        watchdog_s=config.watchdog_s, sweep_interval_s=config.sweep_interval_s,
    )
