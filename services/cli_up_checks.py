"""What ``stageserve up`` checks before it starts anything: its flag types and validations."""

from __future__ import annotations

import argparse
import socket

from services.common.settings import at_least, non_negative, port_number, positive

__all__ = [
    "at_least",
    "check_prefill_cp",
    "check_up_args",
    "non_negative",
    "port_number",
    "positive",
]


def check_up_args(args: argparse.Namespace) -> None:
    """What `up` can tell before starting anything: ``ValueError`` naming the cause."""
    if not (args.model / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {args.model}")
    if args.port:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((args.host, args.port))
            except OSError as exc:
                raise ValueError(
                    f"cannot bind the HTTP port {args.host}:{args.port}: {exc.strerror}"
                ) from None


def check_prefill_cp(cfg) -> None:
    """``ValueError`` naming ``--prefill-cp`` (or its block size) when prefill could not start
    with it."""
    from services.common.rank_devices import rank_devices
    from services.launch_spec import device_of
    from services.prefill.config import check_block_tokens

    device = device_of(cfg, "prefill")
    rank_devices(
        (), cfg.prefill_cp, device, spread_cuda=True, service="prefill", flag="--prefill-cp"
    )
    if cfg.prefill_cp_block_tokens is not None:
        check_block_tokens(cfg.prefill_cp_block_tokens, cfg.page_size)
