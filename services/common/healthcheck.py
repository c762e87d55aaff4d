"""``python -m services.common.healthcheck HOST:PORT [SERVICE] [--token-file PATH]``: 0 if SERVING.

For container health checks where no native gRPC probe exists (docker compose). Health
checks need no credentials; with ``--token-file`` the internal token is sent anyway.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import AUTHORIZATION_KEY, AuthConfigError, Credentials, load_token_file


def is_serving(
    address: str, service: str = "", timeout_s: float = 3.0, auth: Credentials | None = None
) -> bool:
    metadata = None if auth is None else ((AUTHORIZATION_KEY, auth.header_value),)
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__)
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("service", nargs="?", default="", help="service name (default: the server)")
    p.add_argument("--token-file", type=Path, default=None, help="send the token in this file")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # usage errors exit 2, like the positional-only CLI before
        return int(exc.code or 0)
    auth = None
    if args.token_file is not None:
        try:
            auth = Credentials(load_token_file(args.token_file, "internal token"))
        except AuthConfigError as exc:
            print(f"healthcheck: error: {exc}", file=sys.stderr)
            return 2
    return 0 if is_serving(args.address, args.service, auth=auth) else 1


if __name__ == "__main__":
    sys.exit(main())
