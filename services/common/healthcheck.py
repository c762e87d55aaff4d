"""``python -m services.common.healthcheck HOST:PORT [SERVICE]``: exit 0 when the server is SERVING.

For container health checks where no native gRPC probe exists (docker compose).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m services.common.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if is_serving(*args) else 1


if __name__ == "__main__":
    sys.exit(main())
