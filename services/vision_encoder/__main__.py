"""``python -m services.vision_encoder``: the vision encoder (a leader and W rank processes)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.malloc import tune_malloc
from services.common.ranks.errors import RankStartError
from services.common.server import HealthState, serve_until_signal
from services.common.service_main import (
    add_common_args,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.vision_encoder.app import build_app, create_grpc_server, rank_group_config
from services.vision_encoder.config import (
    PIXEL_METHODS,
    TRANSFER_BACKENDS,
    VisionEncoderConfig,
    rank_devices,
)
from services.vision_encoder.metrics import VisionEncoderMetrics

logger = logging.getLogger("services.vision_encoder")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.vision_encoder", description=__doc__)
    add_common_args(p)
    p.add_argument(
        "--devices",
        default=None,
        metavar="DEV,DEV,...",
        help="one rank process per device, e.g. cuda:0,cuda:1 (default: --ranks on --device)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="rank processes, each on --device (default 1; with --devices: how many there are)",
    )
    p.add_argument(
        "--cache-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="embedding cache budget of each rank, bytes (W ranks hold W times this)",
    )
    p.add_argument(
        "--max-batch-images",
        type=int,
        default=32,
        help="images one batch takes at most, over all ranks",
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 * 1024 * 1024,
        help="size limit of one compressed image",
    )
    p.add_argument(
        "--default-timeout-s", type=float, default=60.0, help="deadline of a call that carries none"
    )
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=60.0,
        help="a batch's limit on the ranks: a rank past it is declared dead, the rank "
        "group restarts",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=30.0,
        help="health turns NOT_SERVING when encodes wait but no batch starts or ends for this long",
    )
    p.add_argument(
        "--pixel-method",
        default="auto",
        choices=PIXEL_METHODS,
        help="where the ranks resize, normalize and patchify: pil (CPU, bit-exact with "
        "transformers), torch (on the rank's device, within one uint8 level), "
        "auto (torch on CUDA ranks, pil on CPU ranks)",
    )
    p.add_argument(
        "--vit-cuda-graphs",
        type=int,
        default=8,
        help="batch layouts (lists of image grids) whose ViT CUDA graph each CUDA rank keeps, "
        "least recently used out first; a layout is captured the second time it is seen; "
        "0 runs the ViT eagerly (CPU ranks always do)",
    )
    _add_transfer_args(p)
    return p


def _add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transfer-backend",
        default="mooncake",
        choices=TRANSFER_BACKENDS,
        help="embedding rows to prefill (cuda_ipc: GPU to GPU on one host, ranks on CUDA "
        "devices; shm: /dev/shm on one host)",
    )
    p.add_argument(
        "--transfer-host",
        default="127.0.0.1",
        help="address each rank's transfer engine advertises to peers (Mooncake; it "
        "listens on every interface)",
    )
    p.add_argument("--transfer-protocol", default="tcp", help="Mooncake transport: tcp | rdma")
    p.add_argument(
        "--staging-rows",
        type=int,
        default=8192,
        help="rows of each rank's registered send staging buffer (Mooncake)",
    )


def parse_args(argv: list[str] | None) -> VisionEncoderConfig:
    p = _parser()
    a = p.parse_args(argv)
    try:
        config = VisionEncoderConfig(
            model=a.model,
            host=a.host,
            port=a.port,
            metrics_port=a.metrics_port,
            device=a.device,
            dtype=a.dtype,
            log_level=a.log_level.upper(),
            log_format=a.log_format,
            devices=rank_devices(a.devices, a.ranks, a.device),
            transfer_backend=a.transfer_backend,
            transfer_host=a.transfer_host,
            transfer_protocol=a.transfer_protocol,
            staging_rows=a.staging_rows,
            cache_bytes=a.cache_bytes,
            max_batch_images=a.max_batch_images,
            max_image_bytes=a.max_image_bytes,
            default_timeout_s=a.default_timeout_s,
            step_timeout_s=a.step_timeout_s,
            watchdog_s=a.watchdog_s,
            pixel_method=a.pixel_method,
            vit_cuda_graphs=a.vit_cuda_graphs,
            internal_token_file=a.internal_token_file,
            allow_unauthenticated=a.allow_unauthenticated,
            enable_reflection=a.enable_reflection,
        )
        rank_group_config(config, Envs())  # the devices, checked before anything starts
    except ValueError as exc:
        p.error(str(exc))
    return config


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
    try:
        await app.start(health)  # SERVING once every rank is loaded and warmed up
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


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("vision_encoder", config.log_level, config.log_format)
    envs = Envs.from_environ()
    tune_malloc(envs)
    auth = internal_credentials_or_exit(
        "vision_encoder", envs, config.internal_token_file, config.allow_unauthenticated
    )
    try:
        asyncio.run(serve(config, envs, auth))
    except RankStartError as exc:
        print(f"vision_encoder: error: {exc.message}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
