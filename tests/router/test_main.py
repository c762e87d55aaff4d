"""The router as OS processes: ``python -m services.router`` start-up, READY line, health,
SIGTERM; and a decode worker process killed mid-stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx
import pytest

from services.common.client import create_channel, wait_ready
from tests.conftest import REPO
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    process_cluster,
    read_ready,
    serve_http,
    stop_router,
    wait_until,
)

pytestmark = pytest.mark.integration


async def test_router_process_ready_health_and_sigterm(secured_cluster):
    cluster = secured_cluster  # requires the internal token the router process inherits
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.router",
        "--port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--tokenizer-address",
        cluster.tokenizer.address,
        "--prefill-address",
        cluster.prefills[0].address,
        "--decode-address",
        cluster.decodes[0].address,
        "--health-interval-s",
        "0.2",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "STAGESERVE_API_KEY": "sk-process"},
    )
    try:
        ready = await read_ready(process, "router")
        assert set(ready) == {"port", "http_port", "metrics_port"}
        channel = create_channel(f"127.0.0.1:{ready['port']}")
        try:
            await wait_ready(channel, BOUND_S)
        finally:
            await channel.close()
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{ready['http_port']}", timeout=BOUND_S
        ) as http:
            health = await http.get("/health")  # open without the key, the status alone
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            chat = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
            }
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 401
            key = {"authorization": "Bearer sk-process"}  # from STAGESERVE_API_KEY
            reply = await http.post("/v1/chat/completions", json=chat, headers=key)
            assert reply.json()["choices"][0]["message"]["content"] == "Hello"
            detail = (await http.get("/health", headers=key)).json()
            assert cluster.decodes[0].address in {w["address"] for w in detail["workers"]}
            assert (
                await http.get("/metrics", headers=key)
            ).status_code == 404  # not on the API port
            metrics = (await http.get(f"http://127.0.0.1:{ready['metrics_port']}/metrics")).text
            assert "stageserve_router_requests_total" in metrics
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(BOUND_S):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_killed_decode_process_fails_the_stream_and_is_ejected():
    async with process_cluster() as workers:
        app = None
        try:
            # a real server: ASGITransport would buffer the whole stream
            app, url = await serve_http(workers.router_config())
            async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
                body = {
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": "go"}],
                    "stream": True,
                }
                async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    events = [await anext(lines) for _ in range(6)]
                    workers.decode.kill()
                    async with asyncio.timeout(BOUND_S):
                        events += [line async for line in lines]
                events = [e for e in events if e]
                errors = [
                    json.loads(e[6:])["error"] for e in events if e.startswith('data: {"error"')
                ]
                assert [e["type"] for e in errors] == ["service_unavailable"]
                assert events[-1] == "data: [DONE]"
                await wait_until(lambda: not app.registry.is_ready)
                health = await http.get("/health")
                assert health.status_code == 503 and health.json()["missing"] == ["decode"]
        finally:
            if app is not None:
                await stop_router(app)


async def test_router_process_refuses_to_serve_every_interface_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "STAGESERVE_API_KEY"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.router",
        *("--host", "0.0.0.0", "--port", "0", "--http-port", "0", "--metrics-port", "0"),
        *("--tokenizer-address", "127.0.0.1:1", "--prefill-address", "127.0.0.1:1"),
        *("--decode-address", "127.0.0.1:1"),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(BOUND_S):
            stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 1 and b"READY" not in stdout
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("router: error: the API would listen on 0.0.0.0 (not loopback only)")
    assert "--api-key or STAGESERVE_API_KEY" in last and "--insecure-no-api-key" in last
