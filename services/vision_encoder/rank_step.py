"""The encoder's rank step: what each process of its W ranks runs (``STEP_TARGET``).

Each rank is a rank group of ``--tp`` T processes (its encoder rank and W come in its init;
T is the group's size). Every process holds its shard of the vision tower on its device
(the whole tower with T = 1) and runs each step's ViT forward; TP rank 0 also owns the
rank's embedding cache (``cache_bytes``) and embedding sender, and runs its share of the
batch (``worker.EncoderWorker``); the others follow with the forward alone, for their shards
to join its collectives. Warm-up is one ViT forward on every process, before the group
reports ready.
"""

from __future__ import annotations

import time

import torch

from services.common.ranks.step import BaseRankStep, RankContext
from services.common.ranks.subgroups import agree_on_manifest, model_manifest
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.parallel import SINGLE, TensorParallel
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
        if ctx.device == "cpu":  # the host's cores are shared by the W x T processes
            num_processes = init.num_ranks * ctx.world_size
            torch.set_num_threads(max(1, torch.get_num_threads() // num_processes))
        tp = SINGLE
        if ctx.world_size > 1:
            agree_on_manifest(ctx, manifest_of(init, ctx.world_size))
            tp = TensorParallel(ctx.rank, ctx.world_size, ctx.device_group)
        processor = ImageProcessor.from_dir(init.model)
        model = self.load_model(init, torch.device(ctx.device), tp)
        cache = sender = None
        if tp.rank == 0:
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

    def load_model(
        self, init: EncoderRankInit, device: torch.device, tp: TensorParallel = SINGLE
    ) -> Qwen2_5_VLModel:
        """This process's shard of the vision tower on ``device`` (a subclass may build it
        otherwise)."""
        return load_model(init.model, device, init.dtype, components=("vision",), vision_tp=tp)

    def warmup(self) -> None:
        self.worker.warmup()

    def execute(self, step: int, payload: EncodeStepPayload) -> EncodeStepResult:
        return self.worker.execute(payload, time.monotonic())

    def close(self) -> None:
        if self.worker.sender is not None:
            self.worker.sender.close()


def manifest_of(init: EncoderRankInit, tp_size: int) -> dict[str, object]:
    """What a rank's T processes must agree on before they split the tower."""
    return model_manifest(
        init.model,
        dtype=init.dtype,
        tp_size=tp_size,
        pixel_method=init.pixel_method,
        vit_cuda_graphs=init.vit_cuda_graphs,
        max_image_bytes=init.max_image_bytes,
    )
