"""``python -m services.router``: the OpenAI HTTP API and the gRPC Router API in one process.

Prints ``READY router port=<grpc> http_port=<http> metrics_port=<metrics>`` once both
servers listen and the workers have been polled once. gRPC health is SERVING while at
least one worker of every needed kind is ready (the same rule as ``GET /health``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path

from services.common.auth import API_KEY, AuthConfigError, Credentials
from services.common.envs import API_KEY_ENV, Envs
from services.common.exposure import INSECURE_NO_API_KEY_FLAG, ExposureError, check_api_exposure
from services.common.malloc import tune_malloc
from services.common.service_main import (
    add_common_args,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.router.app import GRPC_GRACE_S, RouterApp
from services.router.auth import RouterAccess
from services.router.config import (
    FlowConfig,
    HttpLimits,
    LimitsConfig,
    PolicyName,
    RouterConfig,
    WorkerAddresses,
    default_max_request_bytes,
)

logger = logging.getLogger("services.router")


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    add_common_args(p, runs_model=False, envs=envs)
    envs = envs if envs is not None else Envs.from_environ()
    p.add_argument(
        "--api-key",
        default=envs.api_key,
        help=f"key API callers must send as 'Authorization: Bearer <key>' on /v1/* and "
        f"gRPC Router (default: {API_KEY_ENV}; empty: the API is open, which a non-loopback "
        f"--host / --http-host refuses without {INSECURE_NO_API_KEY_FLAG})",
    )
    p.add_argument(
        INSECURE_NO_API_KEY_FLAG,
        action="store_true",
        help="serve the API without a key although --host or --http-host is not a loopback "
        "address (anyone who reaches the ports may call it)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: the dir name)"
    )
    p.add_argument(
        "--max-context-len",
        type=int,
        default=0,
        help="default: the model's max_position_embeddings",
    )
    p.add_argument("--http-host", default=None, help="HTTP bind address (default: --host)")
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="OpenAI HTTP port (0 = any free port); /metrics is on --metrics-port",
    )
    p.add_argument(
        "--http-reuse-port",
        action="store_true",
        help="share --http-port with other router processes started with this flag "
        "(SO_REUSEPORT: the kernel spreads new connections over them)",
    )
    for kind in ("tokenizer", "prefill", "decode", "encoder"):
        p.add_argument(
            f"--{kind}-address",
            action="append",
            default=[],
            metavar="HOST:PORT",
            help=f"a {kind} worker (repeatable)",
        )
    p.add_argument(
        "--policy", choices=[n.value for n in PolicyName], default=PolicyName.ROUND_ROBIN.value
    )
    p.add_argument(
        "--no-image-prefetch",
        dest="prefetch_images",
        action="store_false",
        help="leave a request's images to prefill's Encode call (default: with one encoder, "
        "send them to its cache as soon as the request is admitted)",
    )
    p.add_argument(
        "--health-interval-s", type=float, default=1.0, help="seconds between worker health polls"
    )
    p.add_argument(
        "--health-timeout-s", type=float, default=1.0, help="timeout of one health check"
    )
    p.add_argument(
        "--health-generate-interval-s",
        type=_non_negative_float,
        default=30.0,
        help="a worker that completed no request for this long runs a one-token health-check "
        "generate through tokenizer, prefill and decode; failing it ejects the worker "
        "until one passes (0: never)",
    )
    p.add_argument(
        "--health-generate-timeout-s",
        type=_positive_float,
        default=30.0,
        help="a health-check generate that takes longer fails",
    )
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request deadline")
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument(
        "--image-fetch-timeout-s",
        type=float,
        default=10.0,
        help="total time for fetching one image URL, redirects and body included",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=0,
        help="when a request sets none; 0 = up to the context",
    )
    # The public input surface: HTTP bodies and image URLs.
    p.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=None,
        help="largest HTTP request body, else 413 (default: one --max-image-bytes image "
        "as base64 + 4 MiB)",
    )
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="also fetch image URLs on private, loopback, link-local and other "
        "non-public addresses",
    )
    p.add_argument(
        "--max-image-redirects",
        type=_non_negative_int,
        default=3,
        help="redirects followed when fetching an image URL",
    )
    add_flow_args(p)
    add_http_limit_args(p)
    return p


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server's connection bounds (``HttpLimits``), held before authentication."""
    defaults = HttpLimits()
    p.add_argument(
        "--http-max-connections",
        type=_positive_int,
        default=defaults.max_connections,
        help="open HTTP connections per router process; more get 503 at once and are closed "
        "(lowered to fit RLIMIT_NOFILE)",
    )
    p.add_argument(
        "--http-max-header-bytes",
        type=_positive_int,
        default=defaults.max_header_bytes,
        help="largest request line + headers, else 431",
    )
    p.add_argument(
        "--http-max-headers",
        type=_positive_int,
        default=defaults.max_headers,
        help="most header fields in a request, else 431",
    )
    p.add_argument(
        "--http-header-timeout-s",
        type=_positive_float,
        default=defaults.header_timeout_s,
        help="a request's line and headers must arrive within this from the connection's start "
        "or the previous response's end, else 408 and the connection is closed",
    )
    p.add_argument(
        "--http-body-timeout-s",
        type=_positive_float,
        default=defaults.body_timeout_s,
        help="a request body that sends nothing for this long has its connection closed",
    )
    p.add_argument(
        "--http-keep-alive-timeout-s",
        type=_positive_float,
        default=defaults.keep_alive_timeout_s,
        help="an idle connection between two requests is closed after this",
    )


def add_flow_args(p: argparse.ArgumentParser) -> None:
    """Progress bound and admission flags (``FlowConfig``)."""
    defaults = FlowConfig()
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=defaults.stall_timeout_s,
        help="each hop (tokenize, Reserve, prefill, each gap between decode messages) must "
        "answer within this, else the request ends UNAVAILABLE",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=defaults.max_concurrent_requests,
        help="requests past tokenization in flight at once",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="requests waiting for a slot; more get 429 at once",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        default=defaults.queue_timeout_s,
        help="how long a request may wait for a slot and for KV pages in all, then 429",
    )


def flow_config_from_args(args: argparse.Namespace) -> FlowConfig:
    try:
        return FlowConfig(
            stall_timeout_s=args.stall_timeout_s,
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            queue_timeout_s=args.queue_timeout_s,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _context_len(model_dir: Path) -> int:
    from services.engine.config import ModelConfig

    return ModelConfig.from_dir(model_dir).text.max_position_embeddings


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    model_dir = args.model.resolve()
    return RouterConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name or model_dir.name,
        max_context_len=args.max_context_len or _context_len(model_dir),
        workers=WorkerAddresses(
            tokenizer=tuple(args.tokenizer_address),
            prefill=tuple(args.prefill_address),
            decode=tuple(args.decode_address),
            encoder=tuple(args.encoder_address),
        ),
        limits=LimitsConfig(
            request_timeout_s=args.request_timeout_s,
            max_image_bytes=args.max_image_bytes,
            image_fetch_timeout_s=args.image_fetch_timeout_s,
            default_max_tokens=args.default_max_tokens,
            max_request_bytes=args.max_request_bytes
            or default_max_request_bytes(args.max_image_bytes),
            allow_private_image_urls=args.allow_private_image_urls,
            max_image_redirects=args.max_image_redirects,
        ),
        flow=flow_config_from_args(args),
        http=HttpLimits(
            max_connections=args.http_max_connections,
            max_header_bytes=args.http_max_header_bytes,
            max_headers=args.http_max_headers,
            header_timeout_s=args.http_header_timeout_s,
            body_timeout_s=args.http_body_timeout_s,
            keep_alive_timeout_s=args.http_keep_alive_timeout_s,
        ),
        policy=PolicyName(args.policy),
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        health_generate_interval_s=args.health_generate_interval_s,
        health_generate_timeout_s=args.health_generate_timeout_s,
        host=args.host,
        port=args.port,
        http_host=args.http_host or args.host,
        http_port=args.http_port,
        http_reuse_port=args.http_reuse_port,
        prefetch_images=args.prefetch_images,
        metrics_port=args.metrics_port,
        log_level=args.log_level.upper(),
        log_format=args.log_format,
    )


def access_from_args(args: argparse.Namespace, envs: Envs) -> RouterAccess:
    """The router's secrets; exits with one error line when the internal token is missing, a
    secret is unusable, or the API would listen beyond loopback without a key."""
    internal = internal_credentials_or_exit(
        "router", envs, args.internal_token_file, args.allow_unauthenticated
    )
    api_key = None
    if args.api_key:
        try:
            api_key = Credentials(args.api_key.strip(), API_KEY)
        except AuthConfigError as exc:
            raise SystemExit(f"router: error: --api-key / {API_KEY_ENV}: {exc}") from None
    hosts = (args.host, args.http_host or args.host)
    try:
        check_api_exposure(hosts, api_key is not None, args.insecure_no_api_key)
    except ExposureError as exc:
        raise SystemExit(f"router: error: {exc}") from None
    if api_key is None:
        logger.warning(
            "no API key (--api-key / %s): anyone who reaches the HTTP or gRPC port "
            "may call the API",
            API_KEY_ENV,
        )
    return RouterAccess(internal, api_key, args.enable_reflection)


def bind_http_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The HTTP listening socket; ``reuse_port``: other router processes bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def serve(cfg: RouterConfig, metrics_port: int, access: RouterAccess) -> None:
    from services.common.server import serve_until_signal

    app = RouterApp.build(cfg, access=access)
    http_socket = bind_http_socket(cfg.http_host, cfg.http_port, cfg.http_reuse_port)
    await app.start(http_socket)
    print_ready(
        "router",
        port=app.grpc_port,
        http_port=http_socket.getsockname()[1],
        metrics_port=metrics_port,
    )
    await serve_until_signal(app.grpc_server, app.health, app.stop, grace_s=GRPC_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    envs = Envs.from_environ()
    tune_malloc(envs)
    args = build_parser(envs).parse_args(argv)
    cfg = config_from_args(args)
    setup_logging("router", cfg.log_level, cfg.log_format)
    access = access_from_args(args, envs)
    metrics_port = start_telemetry(
        "router", envs, cfg.host, cfg.metrics_port, model_name=cfg.served_model_name
    )
    asyncio.run(serve(cfg, metrics_port, access))
    return 0


if __name__ == "__main__":
    sys.exit(main())
