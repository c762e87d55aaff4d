"""Liveness depends on the process only: a router with every worker down is alive, not ready.

Kubernetes (and compose) probe liveness with the ``liveness`` health service name and
readiness with the server's status (``""``); restarting a router because its workers
are down would only add a cold start to an outage.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.system_load import free_port
from services.common import healthcheck
from services.common.server import LIVENESS_SERVICE, HealthState
from services.router.config import LimitsConfig, PolicyName, RouterConfig, WorkerAddresses
from tests.conftest import TINY_MODEL_DIR
from tests.router.conftest import start_router

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_liveness_is_serving_in_every_readiness_state() -> None:
    health = HealthState()
    health.add_service_names(["stageserve.v1.Decode"])
    assert (health.status(""), health.status(LIVENESS_SERVICE)) == (NOT_SERVING, SERVING)
    health.set_serving(True)
    assert (health.status(""), health.status(LIVENESS_SERVICE)) == (SERVING, SERVING)
    health.set_serving(False)
    assert health.status(LIVENESS_SERVICE) == SERVING
    health.enter_shutdown()
    assert (health.status("stageserve.v1.Decode"), health.status(LIVENESS_SERVICE)) == (
        NOT_SERVING,
        SERVING,
    )
    assert health.status("stageserve.v1.Nope") == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


async def check(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
    return reply.status


def unreachable_router_config() -> RouterConfig:
    """Every worker kind at a loopback port nothing listens on."""
    dead = tuple(f"127.0.0.1:{free_port()}" for _ in range(4))
    return RouterConfig(
        model=TINY_MODEL_DIR,
        served_model_name="tiny-qwen2.5-vl",
        max_context_len=4096,
        workers=WorkerAddresses(
            tokenizer=dead[:1], prefill=dead[1:2], decode=dead[2:3], encoder=dead[3:]
        ),
        limits=LimitsConfig(request_timeout_s=5.0),
        health_interval_s=0.1,
        health_timeout_s=0.5,
        policy=PolicyName.ROUND_ROBIN,
        http_port=0,
    )


@pytest.mark.integration
async def test_router_with_every_worker_down_is_alive_and_not_ready() -> None:
    app = await start_router(unreachable_router_config(), wait_ready=False)
    address = f"127.0.0.1:{app.grpc_port}"
    try:
        await asyncio.sleep(0.5)  # several health polls of the dead workers
        assert not app.registry.is_ready
        assert await check(address, "") == NOT_SERVING
        assert await check(address, LIVENESS_SERVICE) == SERVING
        # the compose health checks: exit 0 for liveness, 1 for readiness
        assert await asyncio.to_thread(healthcheck.main, [address, LIVENESS_SERVICE]) == 0
        assert await asyncio.to_thread(healthcheck.main, [address]) == 1
    finally:
        await app.grpc_server.stop(None)
        await app.stop()
    assert not app.health.is_serving


def test_k8s_liveness_probes_keep_the_launchers_bound() -> None:
    """A process that answers nothing is restarted after as long as ``stageserve up`` waits
    (``LivenessPolicy``): failureThreshold probes, periodSeconds apart."""
    import yaml

    from services.launch_config import LivenessPolicy
    from tests.deploy.manifests import K8S

    policy = LivenessPolicy()
    probes = [
        container["livenessProbe"]
        for path in sorted((K8S / "base").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") in ("Deployment", "StatefulSet")
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]
    assert len(probes) == 5
    for probe in probes:
        assert probe["grpc"]["service"] == LIVENESS_SERVICE
        assert probe["periodSeconds"] * probe["failureThreshold"] == policy.timeout_s
        assert probe["timeoutSeconds"] <= policy.interval_s
