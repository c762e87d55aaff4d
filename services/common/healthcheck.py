"""One ``grpc.health.v1`` ``Check`` client, and its command line.

``check`` (a blocking channel) and ``check_async`` (a ``grpc.aio`` channel) send the same
request and read the answer the same way (``HealthAnswer``); ``is_serving`` is the blocking
one-shot used by the launcher's liveness probe, ``wait_ready`` (``services.common.client``)
and the router's ``HealthProbe`` (``router/health_probe.py``) use ``check_async``.

``python -m services.common.healthcheck HOST:PORT [SERVICE] [--token-file PATH]``: 0 if
SERVING. For container health checks where no native gRPC probe exists (docker compose).
Health checks need no credentials; with ``--token-file`` the internal token is sent anyway.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import AUTHORIZATION_KEY, AuthConfigError, Credentials, load_token_file

_SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)


@dataclass(frozen=True)
class HealthAnswer:
    """The outcome of one ``Check``: the peer's status name, or the RPC error that came instead."""

    status: str | None  # "SERVING", "NOT_SERVING", ...; None: the peer did not answer
    code: grpc.StatusCode | None = None  # the RPC's error code when ``status`` is None
    details: str = ""

    @classmethod
    def of_reply(cls, reply: health_pb2.HealthCheckResponse) -> HealthAnswer:
        return cls(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    @classmethod
    def of_error(cls, exc: grpc.RpcError) -> HealthAnswer:
        return cls(None, exc.code(), exc.details() or "")

    @property
    def is_serving(self) -> bool:
        return self.status == _SERVING

    @property
    def why_not_serving(self) -> str | None:
        """None when SERVING, else the status name or ``CODE: details``."""
        if self.is_serving:
            return None
        if self.status is not None:
            return self.status
        assert self.code is not None
        return f"{self.code.name}: {self.details}"


def check(
    channel: grpc.Channel,
    *,
    service: str = "",
    timeout_s: float,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> HealthAnswer:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=metadata
        )
    except grpc.RpcError as exc:
        return HealthAnswer.of_error(exc)
    return HealthAnswer.of_reply(reply)


async def check_async(
    stub: health_pb2_grpc.HealthStub, *, service: str = "", timeout_s: float
) -> HealthAnswer:
    """``stub``: a ``HealthStub`` over a ``grpc.aio`` channel (its metadata comes from the
    channel's interceptors)."""
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        return HealthAnswer.of_error(exc)
    return HealthAnswer.of_reply(reply)


def is_serving(
    address: str, service: str = "", timeout_s: float = 3.0, auth: Credentials | None = None
) -> bool:
    metadata = None if auth is None else ((AUTHORIZATION_KEY, auth.header_value),)
    with grpc.insecure_channel(address) as channel:
        return check(channel, service=service, timeout_s=timeout_s, metadata=metadata).is_serving


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck", description="Exit 0 if the peer is SERVING."
    )
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
