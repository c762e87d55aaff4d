"""Requests and SSE parsing shared by the HTTP API tests (test_http_*.py, test_openai_*.py)."""

from __future__ import annotations

import base64
import json

import httpx

from tests.router.conftest import (
    MODEL_NAME,
    Cluster,
)

EXPECTED = "Hello there, world!"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}]}
COMPLETION = {"model": MODEL_NAME, "prompt": "Once upon"}


def prompt_len(cluster: Cluster) -> int:
    return len(next(iter(cluster.decode.reserved.values())).prompt_token_ids)


def body_for(path: str, **fields) -> dict:
    return {**(CHAT if path == CHAT_PATH else COMPLETION), **fields}


async def assert_400(http: httpx.AsyncClient, path: str, body: dict, param: str) -> str:
    """The 400's message, once its error names ``param``."""
    response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def sse_events(body: str) -> list[str]:
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.strip()]
    assert all(not e.startswith("data:") for e in events)
    return events


async def stream_chat(http: httpx.AsyncClient, **extra) -> list:
    response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True, **extra})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _image_chat(url: str) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]
    return {**CHAT, "messages": [{"role": "user", "content": content}]}


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _raw(body: dict) -> bytes:
    """``body`` as JSON with NaN/Infinity literals and escaped lone surrogates, as a client may
    send."""
    return json.dumps(body).encode()
