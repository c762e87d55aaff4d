"""Shared helpers for the benchmark tests.

The serving benchmark's fake OpenAI-compatible server on 127.0.0.1 streams ``max_tokens``
tokens (one word each, ``batch-3`` packs three per chunk) with small sleeps, reports usage
(prompt tokens = words + 100 per image + 5; completions: words), counts tokens as words on
``/tokenize``, and fails on demand by model name.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.serve import main
from tests.conftest import REPO


@pytest.fixture
def quick_benchmark(tmp_path: Path) -> Callable[..., str]:
    """Run ``python -m <module> --quick <args>`` into a temporary report that already holds
    ``other_title``'s section; returns the report's text, checked to keep that section and to
    hold ``title``'s."""

    def run(module: str, title: str, other_title: str, *args: str) -> str:
        out = tmp_path / "benchmarks.md"
        out.write_text(f"# Benchmarks\n\n{other_title}\n\nkept\n")
        command = [sys.executable, "-m", module, "--quick", *args, "--out", str(out)]
        command += ["--workdir", str(tmp_path / "work")]
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        text = out.read_text()
        assert "kept" in text and title in text
        return text

    return run


# --- the serving benchmark's fake server ----------------------------------------


TEMPLATE_TOKENS = 5
IMAGE_TOKENS = 100


class FakeState:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.num_tokenize_calls = 0


STATE = FakeState()


def _chunk(delta: dict, finish_reason: str | None = None, is_chat: bool = True) -> str:
    if is_chat:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        event = {"object": "chat.completion.chunk", "choices": [choice]}
    else:
        choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason}
        event = {"object": "text_completion", "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n"


class WordCounter:
    """Tokens are whitespace-separated words (what the fake server counts)."""

    async def count(self, texts) -> list[int]:
        return [len(text.split()) for text in texts]


def _prompt_tokens(body: dict) -> int:
    if "prompt" in body:
        return len(body["prompt"].split())
    content = body["messages"][0]["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    words = sum(len(p["text"].split()) for p in parts if p["type"] == "text")
    return words + IMAGE_TOKENS * sum(p["type"] == "image_url" for p in parts) + TEMPLATE_TOKENS


async def _events(body: dict):
    model, num_tokens = body["model"], body["max_tokens"]
    per_chunk = 3 if model == "batch-3" else 1
    delay = 5.0 if model == "slow" else 0.002
    is_chat = "messages" in body
    STATE.num_in_flight += 1
    STATE.max_in_flight = max(STATE.max_in_flight, STATE.num_in_flight)
    try:
        if is_chat:
            yield _chunk({"role": "assistant", "content": ""})
        await asyncio.sleep(0.01)
        for start in range(0, num_tokens, per_chunk):
            if model == "error-event" and start == 2:
                yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 503}})}\n\n"
                return
            yield _chunk({"content": " tok" * min(per_chunk, num_tokens - start)}, is_chat=is_chat)
            await asyncio.sleep(delay)
        yield _chunk({}, finish_reason="length", is_chat=is_chat)
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": num_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + num_tokens
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        STATE.num_in_flight -= 1


def _reply(body: dict) -> dict:
    """A whole (non-streamed) completion of ``max_tokens`` words."""
    num_tokens, text = body["max_tokens"], " tok" * body["max_tokens"]
    usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": num_tokens}
    if "messages" in body:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    return {"choices": [{**choice, "finish_reason": "length"}], "usage": usage}


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await request.json()
        STATE.num_tokenize_calls += 1
        assert body["add_special_tokens"] is False and body["model"]
        return {"count": len(body["prompt"].split()), "max_model_len": 4096, "tokens": []}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        STATE.bodies.append(body)
        STATE.auth_headers.append(request.headers.get("authorization"))
        if body["model"] == "fail-500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if body["model"] == "fail-400":
            return JSONResponse(
                {"error": {"message": "bad prompt", "type": "invalid_request_error"}}, 400
            )
        if body.get("stream") is False:
            return _reply(body)
        return StreamingResponse(_events(body), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def base_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake_app(), log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline_mono = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline_mono, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def state() -> FakeState:
    STATE.__init__()
    return STATE


# Tokens are whitespace-separated words, as the fake server counts them (counting locally is fast).
WORD_TOKENIZER = Path(__file__).parent / "word_tokenizer.json"


def run(base_url: str, tmp_path, *args: str, tokenizer: bool = True) -> tuple[int, dict]:
    """One benchmark run; ``tokenizer=False`` counts tokens with the server's /tokenize."""
    out = tmp_path / "run.json"
    count_with = ["--tokenizer", str(WORD_TOKENIZER) if tokenizer else "server"]
    common = ["--base-url", base_url, "--output-json", str(out), "--request-timeout-s", "10"]
    rc = main([*common, *count_with, *args])
    return rc, json.loads(out.read_text())
