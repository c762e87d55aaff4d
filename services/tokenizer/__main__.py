"""``python -m services.tokenizer``: one tokenizer process (gRPC ``stageserve.v1.Tokenizer``).

Prints ``READY tokenizer port=<grpc port> metrics_port=<port>`` on stdout once its
workers have loaded the tokenizer; logs go to stderr. SIGTERM/SIGINT: not serving,
finish in-flight calls (grace), stop the workers, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.errors import StageServeError
from services.common.malloc import tune_malloc
from services.common.pb.stageserve.v1 import tokenizer_pb2_grpc
from services.common.server import HealthState, create_server, serve_until_signal
from services.common.service_main import (
    add_common_args,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.tokenizer.config import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_QUEUED_BYTES,
    WORKER_LIVENESS_TIMEOUT_S,
    Limits,
    TokenizerConfig,
    default_num_workers,
)
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.pipeline import max_model_len_of
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.workers import WorkerPool

logger = logging.getLogger("services.tokenizer")


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.tokenizer", description=__doc__.splitlines()[0]
    )
    add_common_args(p, runs_model=False, envs=envs)
    p.add_argument(
        "--num-workers",
        type=int,
        default=default_num_workers(),
        help="worker processes for tokenization and image decoding (default: one per CPU, "
        "at most 4; 0: one thread in this process)",
    )
    p.add_argument(
        "--max-queued-bytes",
        type=int,
        default=MAX_QUEUED_BYTES,
        help="encoded requests waiting for or held by the workers; past it a request is "
        "refused as overloaded (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--worker-liveness-timeout-s",
        type=float,
        default=WORKER_LIVENESS_TIMEOUT_S,
        help="a worker process that does not beat for this long (stopped, hung) is killed and "
        "the workers restarted; the jobs they held fail as unavailable",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompts must be shorter than this many tokens (default: config.json "
        "max_position_embeddings)",
    )
    p.add_argument(
        "--max-image-bytes", type=int, default=MAX_IMAGE_BYTES, help="largest compressed image"
    )
    p.add_argument(
        "--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS, help="largest decoded image (w*h)"
    )
    return p


def parse_config(argv: list[str] | None, envs: Envs) -> tuple[TokenizerConfig, argparse.Namespace]:
    """The tokenizer's config, and the parsed flags (``main`` reads the common auth flags there)."""
    parser = build_parser(envs)
    args = parser.parse_args(argv)
    for flag in ("num_workers", "max_image_bytes", "max_image_pixels", "max_queued_bytes"):
        if getattr(args, flag) < (0 if flag == "num_workers" else 1):
            parser.error(f"--{flag.replace('_', '-')} is out of range: {getattr(args, flag)}")
    if not args.worker_liveness_timeout_s > 0:
        parser.error(
            f"--worker-liveness-timeout-s must be > 0, got {args.worker_liveness_timeout_s}"
        )
    max_model_len = (
        args.max_model_len if args.max_model_len is not None else max_model_len_of(args.model)
    )
    if max_model_len < 2:
        parser.error(f"--max-model-len must be at least 2, got {max_model_len}")
    config = TokenizerConfig(
        model_dir=args.model,
        limits=Limits(max_model_len, args.max_image_bytes, args.max_image_pixels),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        num_workers=args.num_workers,
        max_queued_bytes=args.max_queued_bytes,
        worker_liveness_timeout_s=args.worker_liveness_timeout_s,
        log_level=args.log_level.upper(),
        log_format=args.log_format,
    )
    return config, args


async def serve(
    config: TokenizerConfig,
    envs: Envs,
    auth: Credentials | None,
    *,
    enable_reflection: bool = False,
) -> None:
    metrics_port = start_telemetry(
        "tokenizer",
        envs,
        config.host,
        config.metrics_port,
        model_name=config.model_dir.resolve().name,
    )
    pool = WorkerPool(
        config.model_dir,
        config.limits,
        config.num_workers,
        config.max_queued_bytes,
        config.worker_liveness_timeout_s,
    )
    servicer = TokenizerServicer(pool, TokenizerMetrics())
    health = HealthState()
    server, port = create_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer)],
        config.port,
        config.host,
        [SERVICE_NAME],
        health=health,
        auth=auth,
        enable_reflection=enable_reflection,
    )
    await server.start()  # live (NOT_SERVING) while the workers load
    try:
        await pool.start()
    except BaseException:
        pool.close()
        await server.stop(None)
        raise
    health.set_serving(True)
    logger.info(
        "serving %s on %s:%d with %d workers (queue %d bytes), %s",
        config.model_dir,
        config.host,
        port,
        config.num_workers,
        config.max_queued_bytes,
        config.limits,
    )
    print_ready("tokenizer", port=port, metrics_port=metrics_port)
    await serve_until_signal(server, health, pool.close)


def main(argv: list[str] | None = None) -> int:
    envs = Envs.from_environ()
    tune_malloc(envs)
    try:
        config, args = parse_config(argv, envs)
        setup_logging("tokenizer", config.log_level, config.log_format)
        auth = internal_credentials_or_exit(
            "tokenizer", envs, args.internal_token_file, args.allow_unauthenticated
        )
        asyncio.run(serve(config, envs, auth, enable_reflection=args.enable_reflection))
    except StageServeError as exc:
        print(f"tokenizer: error: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
