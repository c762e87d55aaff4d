"""``python -m services.vision_encoder``: the vision encoder (a leader and W ranks of ``--tp``
processes each)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.envs import Envs
from services.common.malloc import tune_malloc
from services.common.rank_devices import add_rank_args, rank_devices
from services.common.ranks.errors import RankStartError
from services.common.service_main import (
    build_service_parser,
    internal_credentials_or_exit,
    setup_logging,
)
from services.common.settings import config_from_args
from services.vision_encoder.app import rank_group_configs, serve
from services.vision_encoder.config import VisionEncoderConfig, check_vision_split


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    p = build_service_parser(
        "python -m services.vision_encoder", __doc__, VisionEncoderConfig, envs=envs
    )
    add_rank_args(
        p,
        "rank processes on --device: encoder ranks x --tp (default 1; with --devices: how "
        "many there are)",
    )
    return p


def parse_args(argv: list[str] | None) -> VisionEncoderConfig:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        devices = rank_devices(
            a.devices, a.ranks, a.device, spread_cuda=False, service="vision_encoder"
        )
        config = config_from_args(VisionEncoderConfig, a, devices=devices)
        check_vision_split(config.model, config.tp)
        rank_group_configs(config, Envs())  # the devices, checked before anything starts
    except ValueError as exc:
        p.error(str(exc))
    return config


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
