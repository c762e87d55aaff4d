"""``python -m services.tokenizer``: one tokenizer process (gRPC ``stageserve.v1.Tokenizer``).

Prints ``READY tokenizer port=<grpc port> metrics_port=<port>`` on stdout once its
workers have loaded the tokenizer; logs go to stderr. SIGTERM/SIGINT: not serving,
finish in-flight calls (grace), stop the workers, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.envs import Envs
from services.common.errors import StageServeError
from services.common.malloc import tune_malloc
from services.common.service_main import (
    build_service_parser,
    internal_credentials_or_exit,
    setup_logging,
)
from services.common.settings import config_from_args
from services.tokenizer.app import serve
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.pipeline import max_model_len_of


def build_parser(envs: Envs | None = None) -> argparse.ArgumentParser:
    return build_service_parser(
        "python -m services.tokenizer",
        __doc__.splitlines()[0],
        TokenizerConfig,
        runs_model=False,
        envs=envs,
    )


def parse_config(argv: list[str] | None, envs: Envs) -> tuple[TokenizerConfig, argparse.Namespace]:
    """The tokenizer's config (``max_model_len`` read from the checkpoint when not given), and
    the parsed flags."""
    parser = build_parser(envs)
    args = parser.parse_args(argv)
    max_model_len = args.max_model_len or max_model_len_of(args.model)
    if max_model_len < 2:
        parser.error(f"--max-model-len must be at least 2, got {max_model_len}")
    return config_from_args(TokenizerConfig, args, max_model_len=max_model_len), args


def main(argv: list[str] | None = None) -> int:
    envs = Envs.from_environ()
    tune_malloc(envs, single_arena=True)
    try:
        config, _ = parse_config(argv, envs)
        setup_logging("tokenizer", config.log_level, config.log_format)
        auth = internal_credentials_or_exit(
            "tokenizer", envs, config.internal_token_file, config.allow_unauthenticated
        )
        asyncio.run(serve(config, envs, auth))
    except StageServeError as exc:
        print(f"tokenizer: error: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
