"""``python -m services.vision_encoder``: the vision encoder service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.server import HealthState, serve_until_signal
from services.common.service_main import (
    add_common_args,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.vision_encoder.app import build_app, create_grpc_server
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.metrics import VisionEncoderMetrics

logger = logging.getLogger("services.vision_encoder")


def parse_args(argv: list[str] | None) -> VisionEncoderConfig:
    p = argparse.ArgumentParser(prog="python -m services.vision_encoder", description=__doc__)
    add_common_args(p)
    p.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "inprocess", "shm"])
    p.add_argument("--transfer-host", default="127.0.0.1", help="address the transfer engine advertises to peers (Mooncake; it listens on every interface)")
    p.add_argument("--transfer-protocol", default="tcp", help="Mooncake transport: tcp | rdma")
    p.add_argument("--staging-rows", type=int, default=8192, help="rows of the registered send staging buffer")
    p.add_argument("--cache-bytes", type=int, default=256 * 1024 * 1024, help="embedding cache budget, bytes")
    p.add_argument("--max-batch-images", type=int, default=32, help="images one ViT batch takes at most")
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024, help="size limit of one compressed image")
    p.add_argument("--default-timeout-s", type=float, default=60.0, help="deadline of a call that carries none")
    p.add_argument("--watchdog-s", type=float, default=30.0,
                   help="health turns NOT_SERVING when encodes wait but no batch starts or ends for this long")
    a = p.parse_args(argv)
    if a.watchdog_s <= 0:
        p.error("--watchdog-s must be > 0")
    return VisionEncoderConfig(
        model=a.model, host=a.host, port=a.port, metrics_port=a.metrics_port, device=a.device, dtype=a.dtype,
        log_level=a.log_level.upper(), log_format=a.log_format,
        transfer_backend=a.transfer_backend, transfer_host=a.transfer_host,
        transfer_protocol=a.transfer_protocol, staging_rows=a.staging_rows, cache_bytes=a.cache_bytes,
        max_batch_images=a.max_batch_images, max_image_bytes=a.max_image_bytes,
        default_timeout_s=a.default_timeout_s, watchdog_s=a.watchdog_s,
        internal_token_file=a.internal_token_file, allow_unauthenticated=a.allow_unauthenticated,
        enable_reflection=a.enable_reflection,
    )


async def serve(config: VisionEncoderConfig, envs: Envs, auth: Credentials | None) -> None:
    metrics_port = start_telemetry(
        "vision_encoder", envs, config.host, config.metrics_port, model_name=config.model.resolve().name
    )
    app = await asyncio.to_thread(build_app, config, VisionEncoderMetrics())
    health = HealthState()
    server, port = create_grpc_server(app, config, health, auth)
    await server.start()
    await asyncio.to_thread(app.worker.warmup)
    health.set_serving(True)
    app.leader.progress.start(health)  # readiness follows the engine thread: NOT_SERVING while it is stuck
    logger.info("serving on %s:%d (transfer %s)", config.host, port, config.transfer_backend)
    print_ready("vision_encoder", port=port, metrics_port=metrics_port)
    await serve_until_signal(server, health, app.close)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("vision_encoder", config.log_level, config.log_format)
    envs = Envs.from_environ()
    auth = internal_credentials_or_exit(
        "vision_encoder", envs, config.internal_token_file, config.allow_unauthenticated
    )
    asyncio.run(serve(config, envs, auth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
