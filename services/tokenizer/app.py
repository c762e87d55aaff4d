"""Wiring of the tokenizer process: config -> worker pool, servicer, gRPC server; serve."""

from __future__ import annotations

import logging

from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.pb.stageserve.v1 import tokenizer_pb2_grpc
from services.common.server import HealthState, serve_until_signal
from services.common.service_main import print_ready, service_server, start_telemetry
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.workers import WorkerPool

logger = logging.getLogger("services.tokenizer")


async def serve(
    config: TokenizerConfig,
    envs: Envs,
    auth: Credentials | None,
) -> None:
    metrics_port = start_telemetry(
        "tokenizer",
        envs,
        config.host,
        config.metrics_port,
        model_name=config.model.resolve().name,
    )
    pool = WorkerPool(
        config.model,
        config.limits,
        config.num_workers,
        config.max_queued_bytes,
        config.worker_liveness_timeout_s,
    )
    servicer = TokenizerServicer(pool, TokenizerMetrics())
    health = HealthState()
    server, port = service_server(
        (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer),
        SERVICE_NAME,
        config,
        health,
        auth,
    )
    await server.start()  # live (NOT_SERVING) while the workers load
    try:
        await pool.start()
    except BaseException:
        pool.close()
        await server.stop(None)
        raise
    health.set_serving(True)
    logger.info(
        "serving %s on %s:%d with %d workers (queue %d bytes), %s",
        config.model,
        config.host,
        port,
        config.num_workers,
        config.max_queued_bytes,
        config.limits,
    )
    print_ready("tokenizer", port=port, metrics_port=metrics_port)
    await serve_until_signal(server, health, pool.close)
