"""``python -m services.prefill``: one prefill worker (a leader + C CP ranks x T TP ranks, one
process each) serving gRPC ``Prefill``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.envs import Envs
from services.common.errors import StageServeError
from services.common.gpu_share import GpuShare
from services.common.malloc import tune_malloc
from services.common.rank_devices import add_rank_args, rank_devices
from services.common.service_main import (
    build_service_parser,
    internal_credentials_or_exit,
    setup_logging,
)
from services.common.settings import config_from_args
from services.prefill.app import check_backends, serve
from services.prefill.config import PrefillConfig, check_block_tokens, check_parallel

logger = logging.getLogger("services.prefill")


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    p = build_service_parser("python -m services.prefill", __doc__, PrefillConfig, envs=envs)
    add_rank_args(
        p,
        "rank processes on --device, CP ranks x --tp (cuda: cuda:0 .. cuda:N-1; default 1); or "
        "name them with --devices",
    )
    return p


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        devices = rank_devices(
            args.devices, args.ranks, args.device, spread_cuda=True, service="prefill"
        )
        config = config_from_args(PrefillConfig, args, devices=devices)
        check_block_tokens(config.cp_block_tokens, config.page_size)
        if config.gpu_share_file:  # a path it cannot map fails here, not in a rank
            GpuShare(config.gpu_share_file).close()
        check_backends(config)
        check_parallel(config)
    except ValueError as exc:
        p.error(str(exc))
    return config


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("prefill", config.log_level, config.log_format)
    envs = Envs.from_environ()
    tune_malloc(envs)
    auth = internal_credentials_or_exit(
        "prefill", envs, config.internal_token_file, config.allow_unauthenticated
    )
    try:
        asyncio.run(serve(config, envs, auth))
    except StageServeError as exc:
        logger.error("prefill worker failed to start: %s", exc.message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
