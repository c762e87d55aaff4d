"""The encoder's rank step: what each of its W rank processes runs (``STEP_TARGET``).

Each rank is a rank group of one process (its encoder rank and W come in its init). It
owns the vision tower on its device, its embedding cache (``cache_bytes``) and its
embedding sender; each step it runs its share of one batch (``worker.EncoderWorker``).
Warm-up is one ViT forward, before the group reports ready.
"""

from __future__ import annotations

import time

import torch

from services.common.ranks.step import BaseRankStep, RankContext
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.processing.image import ImageProcessor
from services.transfer import create_embedding_sender
from services.vision_encoder.cache import EmbeddingCacheManager
from services.vision_encoder.rank_messages import (
    EncoderRankInit,
    EncodeStepPayload,
    EncodeStepResult,
)
from services.vision_encoder.worker import EncoderWorker


class EncoderRankStep(BaseRankStep):
    init_type = EncoderRankInit
    payload_type = EncodeStepPayload
    result_type = EncodeStepResult

    def __init__(self, ctx: RankContext, init: EncoderRankInit) -> None:
        if ctx.device == "cpu":  # the host's cores are shared by the W ranks
            torch.set_num_threads(max(1, torch.get_num_threads() // init.num_ranks))
        processor = ImageProcessor.from_dir(init.model)
        model = self.load_model(init, torch.device(ctx.device))
        cache = EmbeddingCacheManager(init.cache_bytes)
        sender = create_embedding_sender(init.transfer)  # last: nothing after it can fail
        self.worker = EncoderWorker(
            init.rank,
            model,
            processor,
            cache,
            sender,
            init.max_image_bytes,
            init.pixel_method,
            init.vit_cuda_graphs,
        )

    def load_model(self, init: EncoderRankInit, device: torch.device) -> Qwen2_5_VLModel:
        """The vision tower on ``device`` (a subclass may build it otherwise)."""
        return load_model(init.model, device, init.dtype, components=("vision",))

    def warmup(self) -> None:
        self.worker.warmup()

    def execute(self, step: int, payload: EncodeStepPayload) -> EncodeStepResult:
        return self.worker.execute(payload, time.monotonic())

    def close(self) -> None:
        self.worker.sender.close()
