"""``python -m services.decode``: one decode rank behind a gRPC server.

Prints ``READY decode port=<grpc port> metrics_port=<port>`` on stdout once the model is
loaded, the KV pool registered with the transfer engine and the engine loop running.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.common import signing
from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.pb.stageserve.v1 import decode_pb2_grpc
from services.common.server import HealthState, create_server, serve_until_signal
from services.common.service_main import (
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
    start_telemetry,
)
from services.decode.builder import build_engine
from services.decode.config import DecodeConfig, parse_config
from services.decode.servicer import SERVICE_NAME, DecodeServicer

logger = logging.getLogger("services.decode")


async def serve(config: DecodeConfig, envs: Envs, auth: Credentials | None) -> None:
    metrics_port = start_telemetry(
        "decode", envs, config.host, config.metrics_port, model_name=config.model.resolve().name
    )
    health = HealthState()
    servicer = DecodeServicer(
        config.reservation_timeout_s, config.max_reservation_s, signing.key_of(auth.token if auth else "")
    )
    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)], config.port, config.host,
        [SERVICE_NAME], health=health, auth=auth, enable_reflection=config.enable_reflection,
    )
    await server.start()  # liveness answers (NOT_SERVING) while the model loads
    engine = await asyncio.to_thread(build_engine, config)
    servicer.attach(engine)
    engine.start()
    health.set_serving(True)
    engine.progress.start(health)  # readiness follows the engine loop: NOT_SERVING while stuck or dead
    print_ready("decode", port=port, metrics_port=metrics_port)

    async def release() -> None:
        engine.progress.stop()
        await asyncio.to_thread(engine.stop)
        engine.receiver.close()

    await serve_until_signal(server, health, release)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    setup_logging("decode", config.log_level, config.log_format)
    envs = Envs.from_environ()
    auth = internal_credentials_or_exit("decode", envs, config.internal_token_file, config.allow_unauthenticated)
    asyncio.run(serve(config, envs, auth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
