"""``python -m services.decode``: one decode rank behind a gRPC server.

Prints ``READY decode port=<grpc port> metrics_port=<port>`` on stdout once the model is
loaded, the KV pool registered with the transfer engine and the engine loop running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from services.common.envs import Envs
from services.common.pb.stageserve.v1 import decode_pb2_grpc
from services.common.server import HealthState, create_server, serve_until_signal
from services.common.service_main import print_ready, setup_logging, start_telemetry
from services.decode.builder import build_engine
from services.decode.config import DecodeConfig, parse_config
from services.decode.engine import DecodeEngine
from services.decode.servicer import SERVICE_NAME, DecodeServicer

logger = logging.getLogger("services.decode")
HEALTH_POLL_S = 1.0


async def watch_health(engine: DecodeEngine, health: HealthState, interval_s: float = HEALTH_POLL_S) -> None:
    """Readiness follows the engine loop: NOT_SERVING while it is stuck or dead."""
    while True:
        is_healthy = engine.is_healthy()
        if is_healthy != health.is_serving:
            logger.warning("decode engine %s", "recovered" if is_healthy else "stuck or stopped: NOT_SERVING")
        health.set_serving(is_healthy)
        await asyncio.sleep(interval_s)


async def serve(config: DecodeConfig) -> None:
    metrics_port = start_telemetry("decode", Envs.from_environ(), config.host, config.metrics_port)
    health = HealthState()
    servicer = DecodeServicer(config.reservation_timeout_s)
    server, port = create_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)], config.port, config.host,
        [SERVICE_NAME], health=health,
    )
    await server.start()  # liveness answers (NOT_SERVING) while the model loads
    engine = await asyncio.to_thread(build_engine, config)
    servicer.attach(engine)
    engine.start()
    watchdog = asyncio.create_task(watch_health(engine, health))
    health.set_serving(True)
    print_ready("decode", port=port, metrics_port=metrics_port)

    async def release() -> None:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        await asyncio.to_thread(engine.stop)
        engine.receiver.close()

    await serve_until_signal(server, health, release)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    setup_logging(config.log_level)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
