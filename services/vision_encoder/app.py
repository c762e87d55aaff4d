"""Wiring: config -> model, cache, sender, rank worker, scheduler, leader, servicer."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.auth import Credentials
from services.common.pb.stageserve.v1 import vision_encoder_pb2, vision_encoder_pb2_grpc
from services.common.server import HealthState, create_server
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.processing.image import ImageProcessor
from services.transfer import create_embedding_sender
from services.transfer.embeddings import BaseEmbeddingSender
from services.vision_encoder.cache import EmbeddingCacheManager
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.job import JobLimits
from services.vision_encoder.leader import EncoderLeader
from services.vision_encoder.metrics import VisionEncoderMetrics
from services.vision_encoder.scheduler import EncodeScheduler
from services.vision_encoder.servicer import VisionEncoderServicer
from services.vision_encoder.worker import EncoderWorker

SERVICE_NAME = vision_encoder_pb2.DESCRIPTOR.services_by_name["VisionEncoder"].full_name


@dataclass
class VisionEncoderApp:
    leader: EncoderLeader
    worker: EncoderWorker
    sender: BaseEmbeddingSender
    servicer: VisionEncoderServicer

    def close(self) -> None:
        """Stop the batch loop (waiting calls fail UNAVAILABLE), then release the transfer engine."""
        self.leader.stop()
        self.sender.close()


def create_sender(config: VisionEncoderConfig) -> BaseEmbeddingSender:
    if config.transfer_backend == "mooncake":
        return create_embedding_sender(
            "mooncake", hostname=config.transfer_host, protocol=config.transfer_protocol,
            staging_rows=config.staging_rows,
        )
    return create_embedding_sender(config.transfer_backend)


def build_app(
    config: VisionEncoderConfig,
    metrics: VisionEncoderMetrics,
    sender: BaseEmbeddingSender | None = None,
    model: Qwen2_5_VLModel | None = None,
) -> VisionEncoderApp:
    """Load the vision tower (unless ``model`` is given) and wire one rank; the leader is started."""
    if config.world_size != 1:
        raise ValueError(f"world_size {config.world_size}: only a single encoder rank is supported yet")
    model = model if model is not None else load_model(config.model, config.device, config.dtype, components=("vision",))
    sender = sender if sender is not None else create_sender(config)
    worker = EncoderWorker(
        model, ImageProcessor.from_dir(config.model), EmbeddingCacheManager(config.cache_bytes), sender,
        config.max_image_bytes,
    )
    leader = EncoderLeader(EncodeScheduler(config.max_batch_images), [worker], metrics, watchdog_s=config.watchdog_s)
    limits = JobLimits(worker.merge_size, worker.hidden_size, sender.backend)
    servicer = VisionEncoderServicer(leader, limits, config.default_timeout_s)
    leader.start()
    return VisionEncoderApp(leader, worker, sender, servicer)


def create_grpc_server(
    app: VisionEncoderApp, config: VisionEncoderConfig, health: HealthState, auth: Credentials | None = None
) -> tuple[grpc.aio.Server, int]:
    """The encoder's gRPC server; ``auth``: the internal token callers must send (None: none)."""
    return create_server(
        [(vision_encoder_pb2_grpc.add_VisionEncoderServicer_to_server, app.servicer)],
        port=config.port, host=config.host, service_names=[SERVICE_NAME], health=health,
        auth=auth, enable_reflection=config.enable_reflection,
    )
