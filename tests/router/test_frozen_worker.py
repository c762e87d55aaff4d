"""A decode worker process frozen with SIGSTOP mid-stream: the live stream ends within the stall
bound (not the request deadline), and after SIGCONT the router serves again."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import replace

import httpx
import pytest

from services.router.config import FlowConfig
from tests.conftest import REPO
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    Cluster,
    router_config,
    serve_http,
    stop_router,
    wait_until,
)
from tests.router.fakes import FakePrefill, FakeTokenizer, Script, start_worker
from tests.router.test_main import read_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STALL_S = 1.0


async def test_a_frozen_decode_ends_its_live_stream_within_the_stall_bound():
    script = Script()
    tokenizer = await start_worker(FakeTokenizer(script))
    prefill = await start_worker(FakePrefill(script))
    decode = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.router.fakes",
        "decode",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    app = None
    try:
        decode_port = (await read_ready(decode, "decode"))["port"]
        flow = FlowConfig(stall_timeout_s=STALL_S)
        cfg = router_config(Cluster(script, tokenizer, [prefill], []), flow=flow)
        cfg = replace(cfg, workers=replace(cfg.workers, decode=(f"127.0.0.1:{decode_port}",)))
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
            errors = [json.loads(e[6:])["error"] for e in events if e.startswith('data: {"error"')]
            assert [e["type"] for e in errors] == ["service_unavailable"]
            assert "the decode worker sent nothing for 1 s" in errors[0]["message"]
            assert events[-1] == "data: [DONE]"
            assert ended_s < STALL_S + 1.0, ended_s
            await wait_until(lambda: not app.registry.is_ready)  # the health poll ejects it too
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
        if decode.returncode is None:
            decode.send_signal(signal.SIGCONT)
            decode.kill()
        await decode.wait()
        await tokenizer.server.stop(None)
        await prefill.server.stop(None)
