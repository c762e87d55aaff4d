"""A decode worker process frozen with SIGSTOP mid-stream: the live stream ends within the stall
bound (not the request deadline), and after SIGCONT the router serves again."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from services.router.config import FlowConfig
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    process_cluster,
    serve_http,
    stop_router,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STALL_S = 1.0


async def test_a_frozen_decode_ends_its_live_stream_within_the_stall_bound():
    async with process_cluster() as workers:
        decode = workers.decode
        app = None
        try:
            cfg = workers.router_config(flow=FlowConfig(stall_timeout_s=STALL_S))
            app, url = await serve_http(cfg)
            async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
                body = {
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": "go"}],
                    "stream": True,
                }
                async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    events = [await anext(lines) for _ in range(6)]
                    decode.send_signal(signal.SIGSTOP)
                    frozen_at = time.monotonic()
                    async with asyncio.timeout(BOUND_S):
                        events += [line async for line in lines]
                    ended_s = time.monotonic() - frozen_at
                events = [e for e in events if e]
                errors = [
                    json.loads(e[6:])["error"] for e in events if e.startswith('data: {"error"')
                ]
                assert [e["type"] for e in errors] == ["service_unavailable"]
                assert "the decode worker sent nothing for 1 s" in errors[0]["message"]
                assert events[-1] == "data: [DONE]"
                assert ended_s < STALL_S + 1.0, ended_s
                # the health poll ejects it too
                await wait_until(lambda: not app.registry.is_ready)
                decode.send_signal(signal.SIGCONT)
                await wait_until(lambda: app.registry.is_ready)
                body = {**body, "stream": False, "max_tokens": 3}
                reply = await http.post("/v1/chat/completions", json=body)
                assert (
                    reply.status_code == 200
                    and reply.json()["choices"][0]["message"]["content"] == "Hxx"
                )
        finally:
            if app is not None:
                await stop_router(app)
