"""``python -m services.decode``: the decode leader behind a gRPC server, and its D rank processes.

Prints ``READY decode port=<grpc port> metrics_port=<port>`` on stdout once every rank is
formed: its model loaded, its KV pool registered with its transfer receiver, warmed up.
"""

from __future__ import annotations

import sys

from services.common.envs import Envs
from services.common.malloc import tune_malloc
from services.common.service_main import internal_credentials_or_exit, setup_logging
from services.decode.app import run
from services.decode.config import parse_config


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    setup_logging("decode", config.log_level, config.log_format)
    envs = Envs.from_environ()
    tune_malloc(envs)
    auth = internal_credentials_or_exit(
        "decode", envs, config.internal_token_file, config.allow_unauthenticated
    )
    run(config, envs, auth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
