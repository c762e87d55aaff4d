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

from services.common import settings
from services.common.auth import API_KEY, AuthConfigError, Credentials
from services.common.envs import API_KEY_ENV, Envs
from services.common.exposure import INSECURE_NO_API_KEY_FLAG, ExposureError, check_api_exposure
from services.common.malloc import tune_malloc
from services.common.service_main import (
    build_service_parser,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.router.app import GRPC_GRACE_S, RouterApp
from services.router.auth import RouterAccess
from services.router.config import RouterConfig

logger = logging.getLogger("services.router")


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    envs = envs if envs is not None else Envs.from_environ()
    p = build_service_parser(
        "python -m services.router", __doc__, RouterConfig, runs_model=False, envs=envs
    )
    p.add_argument(  # a secret: not a config field, so never in a launcher's child argv
        "--api-key",
        default=envs.api_key,
        help=f"key API callers must send as 'Authorization: Bearer <key>' on /v1/* and "
        f"gRPC Router (default: {API_KEY_ENV}; empty: the API is open, which a non-loopback "
        f"--host / --http-host refuses without {INSECURE_NO_API_KEY_FLAG})",
    )
    return p


def _context_len(model_dir: Path) -> int:
    from services.engine.config import ModelConfig

    return ModelConfig.from_dir(model_dir).text.max_position_embeddings


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's config; exits with the message of a value its checks refuse."""
    model = args.model.resolve()
    try:
        return settings.config_from_args(
            RouterConfig,
            args,
            model=model,
            served_model_name=args.served_model_name or model.name,
            max_context_len=args.max_context_len or _context_len(model),
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


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
    await serve_until_signal(
        app.grpc_server, app.health, app.stop, grace_s=GRPC_GRACE_S, drain=app.drain
    )


def main(argv: list[str] | None = None) -> int:
    envs = Envs.from_environ()
    tune_malloc(envs, single_arena=True)
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
