"""Wiring of the leader process: config -> rank groups, scheduler, leader, servicer, readiness.

Each of the W ranks is a rank group of its own, started, stepped and re-formed alone: one
process, or with ``--tp`` T a stepped group of T processes on adjacent devices, its vision
tower split over them (``rank_step``). The leader process reads the checkpoint's config only
(the limits every call is checked against); each rank process loads the vision tower.
Readiness follows the ranks' groups and the progress watchdogs
(``readiness.ReadinessGate``): SERVING while at least one rank serves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.pb.stageserve.v1 import vision_encoder_pb2, vision_encoder_pb2_grpc
from services.common.progress import ProgressWatchdog
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.errors import RankStartError
from services.common.ranks.group import RankGroup
from services.common.server import HealthState, serve_until_signal
from services.common.service_main import (
    print_listening,
    print_ready,
    service_server,
    start_telemetry,
)
from services.engine.config import ModelConfig
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.job import JobLimits
from services.vision_encoder.leader import EncoderLeader
from services.vision_encoder.metrics import VisionEncoderMetrics
from services.vision_encoder.rank_messages import EncoderRankInit, EncodeStepResult, TransferSpec
from services.vision_encoder.readiness import ReadinessGate
from services.vision_encoder.scheduler import EncodeScheduler
from services.vision_encoder.servicer import VisionEncoderServicer

logger = logging.getLogger("services.vision_encoder")
SERVICE_NAME = vision_encoder_pb2.DESCRIPTOR.services_by_name["VisionEncoder"].full_name
STEP_TARGET = "services.vision_encoder.rank_step:EncoderRankStep"  # imported by the ranks only


@dataclass
class VisionEncoderApp:
    leader: EncoderLeader
    servicer: VisionEncoderServicer
    limits: JobLimits
    _loop: asyncio.AbstractEventLoop | None = None
    _gate: ReadinessGate | None = None
    _watchdogs: list[ProgressWatchdog] = field(default_factory=list)

    @property
    def groups(self) -> tuple[RankGroup, ...]:
        return self.leader.groups

    async def start(self, health: HealthState, watchdog_poll_s: float = 1.0) -> None:
        """Form every rank's group (each rank loaded and warmed up; ``RankStartError`` naming
        the rank and cause), start the batch loop; readiness follows the groups and the
        watchdogs."""
        self._loop = asyncio.get_running_loop()
        self._gate = ReadinessGate(health, self.leader.num_ranks)
        await self.leader.start()
        views = [(self.leader.progress, self._gate.view())]
        for rank, group in enumerate(self.groups):
            for watchdog in (group.progress, *group.rank_progress):
                views.append((watchdog, self._gate.view(rank)))
        self._watchdogs = [watchdog for watchdog, _ in views]
        for watchdog, view in views:
            watchdog.start(view, interval_s=watchdog_poll_s)  # type: ignore[arg-type]

    def on_ready_change(self, rank: int, is_ready: bool) -> None:
        """Rank ``rank``'s group readiness (called from that group's thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._apply_ready, rank, is_ready)

    def _apply_ready(self, rank: int, is_ready: bool) -> None:
        if not is_ready:
            self.leader.on_rank_down(rank)
        if self._gate is not None:
            self._gate.set_rank_ready(rank, is_ready)

    async def close(self) -> None:
        """Stop the ranks and the batch loop; every call still waiting fails UNAVAILABLE."""
        for watchdog in self._watchdogs:
            watchdog.stop()
        await self.leader.stop()


def rank_group_configs(config: VisionEncoderConfig, envs: Envs) -> tuple[RankGroupConfig, ...]:
    """Rank ``r``'s group: its ``config.tp`` processes on ``config.rank_devices(r)``."""
    return tuple(
        RankGroupConfig(
            name=f"vision encoder rank {rank}",
            devices=config.rank_devices(rank),
            step_timeout_s=config.step_timeout_s,
            watchdog_s=config.watchdog_s,
            internal_token=envs.internal_token,  # what the spawned rank inherits and sends back
        )
        for rank in range(config.num_ranks)
    )


def rank_init(config: VisionEncoderConfig, rank: int) -> EncoderRankInit:
    transfer = TransferSpec(
        config.transfer_backend, config.transfer_host, config.transfer_protocol, config.staging_rows
    )
    return EncoderRankInit(
        str(config.model),
        config.dtype,
        config.cache_bytes,
        config.max_image_bytes,
        transfer,
        config.pixel_method,
        config.vit_cuda_graphs,
        rank,
        config.num_ranks,
    )


def build_app(
    config: VisionEncoderConfig,
    metrics: VisionEncoderMetrics,
    envs: Envs | None = None,
    *,
    step_target: str = STEP_TARGET,
) -> VisionEncoderApp:
    """Everything but the ranks (``start`` forms them); ``step_target``: the rank step class."""
    envs = envs if envs is not None else Envs.from_environ()
    model = ModelConfig.from_dir(config.model)
    limits = JobLimits(
        model.vision.spatial_merge_size, model.embedding_row_width, config.transfer_backend
    )
    app: VisionEncoderApp  # a group calls back only once started, when ``app`` exists
    groups = [
        RankGroup(
            group_config,
            StepSpec(step_target, EncodeStepResult, rank_init(config, rank)),
            on_ready_change=lambda is_ready, rank=rank: app.on_ready_change(rank, is_ready),
        )
        for rank, group_config in enumerate(rank_group_configs(config, envs))
    ]
    leader = EncoderLeader(
        EncodeScheduler(config.max_batch_images), groups, metrics, watchdog_s=config.watchdog_s
    )
    servicer = VisionEncoderServicer(leader, limits, config.default_timeout_s)
    app = VisionEncoderApp(leader, servicer, limits)
    return app


def create_grpc_server(
    app: VisionEncoderApp,
    config: VisionEncoderConfig,
    health: HealthState,
    auth: Credentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """The encoder's gRPC server; ``auth``: the internal token callers must send (None: none)."""
    registration = (vision_encoder_pb2_grpc.add_VisionEncoderServicer_to_server, app.servicer)
    return service_server(registration, SERVICE_NAME, config, health, auth)


async def serve(config: VisionEncoderConfig, envs: Envs, auth: Credentials | None) -> None:
    metrics_port = start_telemetry(
        "vision_encoder",
        envs,
        config.host,
        config.metrics_port,
        model_name=config.model.resolve().name,
    )
    app = build_app(config, VisionEncoderMetrics(), envs)
    health = HealthState()
    server, port = create_grpc_server(app, config, health, auth)
    await server.start()
    print_listening("vision_encoder", port)  # prefill may start: it waits for SERVING itself
    try:
        await app.start(health)  # SERVING once the ranks are loaded and warmed up
    except RankStartError:
        await server.stop(None)
        raise
    devices = ",".join(config.devices)
    logger.info(
        "serving on %s:%d (ranks on %s, transfer %s)",
        config.host,
        port,
        devices,
        config.transfer_backend,
    )
    print_ready("vision_encoder", port=port, metrics_port=metrics_port)
    await serve_until_signal(server, health, app.close)
