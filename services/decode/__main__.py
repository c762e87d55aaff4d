"""``python -m services.decode``: the decode leader behind a gRPC server, and its D rank processes.

Prints ``READY decode port=<grpc port> metrics_port=<port>`` on stdout once every rank is
formed: its model loaded, its KV pool registered with its transfer receiver, warmed up.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.envs import Envs
from services.common.gpu_share import GpuShare
from services.common.kv_transfer import check_kv_backend
from services.common.malloc import tune_malloc
from services.common.rank_devices import add_rank_args, rank_devices
from services.common.service_main import (
    build_service_parser,
    internal_credentials_or_exit,
    setup_logging,
)
from services.common.settings import config_from_args
from services.decode.app import serve
from services.decode.config import DecodeConfig
from services.engine.parallel import check_rank_split


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    p = build_service_parser(
        "python -m services.decode", "The stageserve decode service.", DecodeConfig, envs=envs
    )
    add_rank_args(
        p,
        "decode rank processes on --device: data-parallel ranks x --tp, each data-parallel "
        "rank with its own KV pool and running batch (default 1; with --devices: how many "
        "there are)",
    )
    return p


def parse_config(argv: list[str] | None = None) -> DecodeConfig:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        devices = rank_devices(
            args.devices, args.ranks, args.device, spread_cuda=False, service="decode"
        )
        config = config_from_args(DecodeConfig, args, devices=devices)
        if config.gpu_share_file:
            try:  # a path it cannot map fails here, not in a rank
                GpuShare(config.gpu_share_file).close()
            except ValueError as exc:
                raise ValueError(f"--gpu-share-file: {exc}") from None
        for device in config.devices:
            check_kv_backend(config.kv_transfer_backend, config.transfer_backend, device)
        check_rank_split(
            config.model, config.devices, config.tp, config.ep, "decode", config.dp_attention
        )
    except ValueError as exc:
        p.error(str(exc))
    return config


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    setup_logging("decode", config.log_level, config.log_format)
    envs = Envs.from_environ()
    tune_malloc(envs)
    auth = internal_credentials_or_exit(
        "decode", envs, config.internal_token_file, config.allow_unauthenticated
    )
    asyncio.run(serve(config, envs, auth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
