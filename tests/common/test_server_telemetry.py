"""The shared gRPC skeleton: telemetry (metrics, request ids, trace context) and graceful
stop."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.client import create_channel, wait_ready
from services.common.pb.stageserve.v1 import decode_pb2
from services.common.server import (
    REQUEST_ID_KEY,
    RpcMetrics,
    current_request_id,
    serve_until_signal,
)
from tests.common.server_helpers import (
    NOT_SERVING,
    REPO_ROOT,
    SERVING,
    TIMEOUT_S,
    Served,
    _rpc_error,
    generate,
)


async def test_metrics_count_rpcs_by_status(served: Served) -> None:
    await served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S)
    await _rpc_error(
        served.decode.Reserve(decode_pb2.ReserveRequest(request_id="capacity"), timeout=TIMEOUT_S)
    )
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in served.decode.Stream(iter(generate("peer-lost"))):
            pass
    metrics = served.metrics
    assert metrics.num_calls("/stageserve.v1.Decode/Stats", "OK") == 1
    assert metrics.num_calls("/stageserve.v1.Decode/Reserve", "RESOURCE_EXHAUSTED") == 1
    assert metrics.num_calls("/stageserve.v1.Decode/Stream", "UNAVAILABLE") == 1
    assert all(s.total_s >= 0.0 for s in metrics.snapshot().values())


async def test_request_id_is_bound_and_forwarded(served: Served) -> None:
    await served.decode.Abort(
        decode_pb2.AbortRequest(), metadata=((REQUEST_ID_KEY, "req-1"),), timeout=TIMEOUT_S
    )
    token = current_request_id.set("req-2")  # as inside a handler: the client forwards it
    try:
        await served.decode.Abort(decode_pb2.AbortRequest(), timeout=TIMEOUT_S)
    finally:
        current_request_id.reset(token)
    await served.decode.Abort(decode_pb2.AbortRequest(), timeout=TIMEOUT_S)
    first, second, fresh = served.servicer.seen_request_ids
    assert (first, second) == ("req-1", "req-2")
    assert len(fresh) == 32  # made up by the server when the caller sent none


async def test_the_callers_trace_context_is_current_in_the_handler(served: Served) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)
    await served.decode.Abort(decode_pb2.AbortRequest(), metadata=metadata, timeout=TIMEOUT_S)
    await served.decode.Abort(decode_pb2.AbortRequest(), timeout=TIMEOUT_S)
    assert served.servicer.seen_trace_ids == [trace_id, ""]  # so the handler's log lines carry it


def test_rpc_metrics_are_exported_to_prometheus() -> None:
    from prometheus_client import REGISTRY

    labels = {"grpc_service": "stageserve.v1.Test", "grpc_method": "Ping"}
    before = (
        REGISTRY.get_sample_value("stageserve_grpc_server_handling_seconds_count", labels) or 0.0
    )
    RpcMetrics().record("/stageserve.v1.Test/Ping", "DEADLINE_EXCEEDED", 0.5)
    handled = REGISTRY.get_sample_value(
        "stageserve_grpc_server_handled_total", {**labels, "grpc_code": "DEADLINE_EXCEEDED"}
    )
    assert handled is not None and handled >= 1
    assert (
        REGISTRY.get_sample_value("stageserve_grpc_server_handling_seconds_count", labels)
        == before + 1
    )


async def test_graceful_shutdown_order(served: Served) -> None:
    served.health.set_serving(True)
    watch = health_pb2_grpc.HealthStub(served.channel).Watch(
        health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S
    )
    assert (await watch.read()).status == SERVING
    released: list[bool] = []  # whether health was already NOT_SERVING when release ran
    stop = asyncio.Event()
    serving = asyncio.create_task(
        serve_until_signal(
            served.server,
            served.health,
            lambda: released.append(served.health.is_serving),
            grace_s=1.0,
            stop=stop,
        )
    )
    stop.set()
    assert (await watch.read()).status == NOT_SERVING
    await asyncio.wait_for(serving, TIMEOUT_S)
    assert released == [False]  # ran exactly once, after NOT_SERVING
    served.health.set_serving(True)
    assert not served.health.is_serving  # shutdown is final
    error = await _rpc_error(served.decode.Stats(decode_pb2.StatsRequest(), timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


SERVER_SCRIPT = """
import asyncio
from services.common.server import HealthState, create_server, serve_until_signal

async def main():
    health = HealthState()
    server, port = create_server([], health=health)
    await server.start()
    health.set_serving(True)
    print(port, flush=True)
    await serve_until_signal(server, health, lambda: print("released", flush=True), grace_s=1.0)

asyncio.run(main())
"""


async def test_sigterm_stops_the_process_cleanly() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER_SCRIPT,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
        channel = create_channel(f"127.0.0.1:{port}")
        try:
            await wait_ready(channel, TIMEOUT_S)
        finally:
            await channel.close()
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert out.decode().split() == ["released"]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
