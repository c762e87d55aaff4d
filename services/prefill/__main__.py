"""``python -m services.prefill``: one prefill worker (a leader + C CP rank processes) serving gRPC
``Prefill``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common import signing
from services.common.auth import Credentials
from services.common.client import create_channel, wait_ready
from services.common.clients.vision_encoder import VisionEncoderClient
from services.common.envs import Envs
from services.common.errors import StageServeError
from services.common.gpu_share import GpuShare
from services.common.kv_transfer import CROSS_PROCESS_BACKENDS, KV_BACKEND_HELP
from services.common.malloc import tune_malloc
from services.common.pb.stageserve.v1 import prefill_pb2_grpc
from services.common.server import HealthState, create_server, serve_until_signal
from services.common.service_main import (
    add_common_args,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.prefill.app import PrefillApp, check_backends
from services.prefill.config import PrefillConfig, check_block_tokens, rank_devices
from services.prefill.image_store import ImageStore
from services.prefill.kv_refs import KvRefVerifier
from services.prefill.servicer import SERVICE_NAME, PrefillServicer

logger = logging.getLogger("services.prefill")


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    p = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__)
    add_common_args(p)
    p.add_argument(
        "--encoder-address", default="", help="vision encoder host:port (empty: text-only prompts)"
    )
    p.add_argument(
        "--transfer-backend",
        default="mooncake",
        help="embedding rows from the encoder (and KV unless --kv-transfer-backend): "
        f"{' | '.join(CROSS_PROCESS_BACKENDS)} (cuda_ipc: into a GPU buffer over CUDA IPC, needs "
        "--device cuda)",
    )
    p.add_argument("--kv-transfer-backend", default=None, help=KV_BACKEND_HELP)
    p.add_argument(
        "--transfer-host",
        "--transfer-hostname",
        dest="transfer_hostname",
        default="",
        help="address the transfer engine advertises (default --host)",
    )
    p.add_argument("--num-pages", type=int, default=1024, help="pages of the local KV pool")
    p.add_argument(
        "--page-size", type=int, default=16, help="tokens per KV page; must equal decode's"
    )
    p.add_argument(
        "--embedding-rows", type=int, default=16384, help="rows of the image-embedding buffer"
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=8192, help="prompt tokens per prefill batch"
    )
    p.add_argument("--max-queued-requests", type=int, default=256)
    p.add_argument("--attention-backend", default="torch")
    p.add_argument(
        "--default-timeout-s", type=float, default=300.0, help="for requests without a deadline"
    )
    p.add_argument(
        "--embedding-quarantine-s",
        type=float,
        default=30.0,
        help="rows of a timed-out Encode wait this long before reuse",
    )
    p.add_argument(
        "--peer-ready-timeout-s",
        type=float,
        default=120.0,
        help="how long to wait at start for the vision encoder to be SERVING",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=30.0,
        help="health turns NOT_SERVING when the worker has a batch but makes no progress for this "
        "long",
    )
    p.add_argument(
        "--max-kv-ref-nonces",
        type=int,
        default=262144,
        help="nonces of used KvRefs kept (each until its KvRef expires, for replay "
        "checks); when full, new requests get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--image-store-mb",
        type=int,
        default=256,
        help="MiB of compressed image bytes held (least recently used out first), so that a "
        "router sends an image's bytes once: later calls name it by its hash alone",
    )
    p.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=640,
        help="a CUDA rank runs a pass of up to this many tokens (not CP-sharded) on CUDA graphs "
        "of every layer but attention, captured at start for token sizes up to it; 0 runs "
        "every pass eagerly (CPU ranks always do)",
    )
    p.add_argument(
        "--gpu-share-file",
        default="",
        help="a file shared with a decode service on the same GPU: each rank marks its forwards "
        "in it and that decode holds its steps back while one runs (its --prefill-first-ms); "
        "stageserve up sets it when prefill and decode share a CUDA device",
    )
    add_cp_args(p)
    args = p.parse_args(argv)
    if args.cuda_graph_max_tokens < 0:
        p.error("--cuda-graph-max-tokens must be >= 0")
    positives = (
        "num_pages",
        "page_size",
        "embedding_rows",
        "max_batch_tokens",
        "max_queued_requests",
        "watchdog_s",
        "max_kv_ref_nonces",
        "image_store_mb",
        "ranks",
        "cp_min_tokens",
        "step_timeout_s",
    )
    for name in positives:
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    try:
        args.devices = rank_devices(args.device, args.devices, args.ranks)
        check_block_tokens(args.cp_block_tokens, args.page_size)
        if args.gpu_share_file:
            GpuShare(args.gpu_share_file).close()  # a path it cannot map fails here, not in a rank
        check_backends(PrefillConfig(**{k: v for k, v in vars(args).items() if k != "ranks"}))
    except ValueError as exc:
        p.error(str(exc))
    del args.ranks
    return PrefillConfig(**vars(args))


def add_cp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="CP rank processes on --device (cuda: cuda:0 .. cuda:C-1); or name them with "
        "--devices",
    )
    p.add_argument(
        "--devices", default="", help="comma-separated devices, one CP rank each (cuda:0,cuda:1)"
    )
    p.add_argument(
        "--cp-block-tokens",
        type=int,
        default=64,
        help="CP shard: block b of a pass's tokens goes to rank b %% C (1, or a multiple of "
        "--page-size)",
    )
    p.add_argument(
        "--cp-min-tokens",
        type=int,
        default=2048,
        help="a batch with fewer prompt tokens runs on one rank (no CP collectives)",
    )
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=60.0,
        help="a batch's deadline on the ranks: a rank past it is declared dead and the group "
        "re-formed",
    )


async def serve(config: PrefillConfig, envs: Envs, auth: Credentials | None) -> int:
    metrics_port = start_telemetry(
        "prefill", envs, config.host, config.metrics_port, model_name=config.model.resolve().name
    )
    health = HealthState()
    kv_refs = KvRefVerifier(signing.key_of(auth.token if auth else ""), config.max_kv_ref_nonces)
    images = ImageStore(config.image_store_mb * 1024 * 1024)
    servicer = PrefillServicer(config.default_timeout_s, kv_refs, images)
    server, port = create_server(
        [(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)],
        config.port,
        config.host,
        [SERVICE_NAME],
        health=health,
        auth=auth,
        enable_reflection=config.enable_reflection,
    )
    await server.start()
    encoder = None
    if config.encoder_address:
        encoder = VisionEncoderClient(config.encoder_address, auth=auth)
        await _wait_encoder_ready(config)
    app = PrefillApp.build(config, internal_token=envs.internal_token, encoder=encoder)
    app.leader.on_serving = (
        health.set_serving
    )  # SERVING once the rank group formed and described itself
    await app.start()
    servicer.attach(app.leader)
    app.leader.progress.start(
        health
    )  # readiness follows the ranks: NOT_SERVING while a plan is stuck
    print_ready("prefill", port=port, metrics_port=metrics_port)

    async def release() -> None:
        await app.close()
        if encoder is not None:
            await encoder.close()

    await serve_until_signal(server, health, release)
    return 0


async def _wait_encoder_ready(config: PrefillConfig) -> None:
    channel = create_channel(config.encoder_address)
    try:
        await wait_ready(channel, config.peer_ready_timeout_s)
    finally:
        await channel.close()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("prefill", config.log_level, config.log_format)
    envs = Envs.from_environ()
    tune_malloc(envs)
    auth = internal_credentials_or_exit(
        "prefill", envs, config.internal_token_file, config.allow_unauthenticated
    )
    try:
        return asyncio.run(serve(config, envs, auth))
    except StageServeError as exc:
        logger.error("prefill worker failed to start: %s", exc.message)
        return 1


if __name__ == "__main__":
    sys.exit(main())
