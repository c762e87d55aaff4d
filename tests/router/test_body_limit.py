"""The HTTP body limit (--max-request-bytes): 413 with an OpenAI error, without reading the body."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import httpx
import pytest

from services.router.config import default_max_request_bytes
from tests.router.conftest import BOUND_S, MODEL_NAME, router_config, serve_http, stop_router

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}]}
SMALL_LIMIT = 64 * 1024
FIFTY_MB = 50 * 1000 * 1000


def assert_413(status: int, body: bytes, limit: int) -> None:
    assert status == 413, body[:200]
    error = json.loads(body)["error"]
    assert error == {
        "message": f"the request body is larger than the limit of {limit} bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a content-length."""
    async with asyncio.timeout(BOUND_S):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split()[1]), body


@pytest.fixture
async def served(cluster):
    cfg = router_config(cluster)
    app, url = await serve_http(
        replace(cfg, limits=replace(cfg.limits, max_request_bytes=SMALL_LIMIT))
    )
    try:
        yield url
    finally:
        await stop_router(app)


async def open_raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = httpx.URL(url).host, httpx.URL(url).port
    return await asyncio.open_connection(host, port)


async def test_declared_length_over_the_limit_is_refused_before_any_body_byte(served):
    reader, writer = await open_raw(served)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: "
            b"application/json\r\n" + f"content-length: {FIFTY_MB}\r\n\r\n".encode()
        )
        await writer.drain()
        status, body = await read_response(reader)  # not one body byte was sent
        assert_413(status, body, SMALL_LIMIT)
    finally:
        writer.close()


async def test_chunked_body_is_refused_at_the_first_chunk_over_the_limit(served):
    reader, writer = await open_raw(served)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: "
            b"application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 16 * 1024
        for _ in range(
            SMALL_LIMIT // len(chunk) + 1
        ):  # one chunk past the limit, then nothing more
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()
        status, body = await read_response(reader)  # the body never ended
        assert_413(status, body, SMALL_LIMIT)
    finally:
        writer.close()


@pytest.mark.parametrize("is_chunked", [False, True])
async def test_an_ordinary_client_gets_the_413_and_the_router_keeps_serving(served, is_chunked):
    """httpx reads the reply only after sending everything; the router drains what it sends."""
    payload = b"x" * (4 * SMALL_LIMIT)

    async def chunks():
        for start in range(0, len(payload), 8192):
            yield payload[start : start + 8192]

    async with httpx.AsyncClient(base_url=served, timeout=BOUND_S) as http:
        response = await http.post(
            "/v1/chat/completions",
            content=chunks() if is_chunked else payload,
            headers={"content-type": "application/json"},
        )
        assert_413(response.status_code, response.content, SMALL_LIMIT)
        ok = await http.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200, ok.text


async def test_a_body_at_the_limit_is_served(served):
    text = "a" * 100
    body = json.dumps(
        {**CHAT, "user": "u" * (SMALL_LIMIT - len(json.dumps({**CHAT, "user": ""})))}
    ).encode()
    assert len(body) == SMALL_LIMIT
    async with httpx.AsyncClient(base_url=served, timeout=BOUND_S) as http:
        response = await http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        over = await http.post(
            "/v1/completions", content=body + b" ", headers={"content-type": "application/json"}
        )
        assert over.status_code == 413
        assert (
            await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": text})
        ).status_code == 200


@pytest.mark.slow
async def test_50_mb_body_is_refused_fast_with_the_default_limit(cluster):
    cfg = router_config(cluster)
    limit = default_max_request_bytes(cfg.limits.max_image_bytes)
    app, url = await serve_http(replace(cfg, limits=replace(cfg.limits, max_request_bytes=limit)))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
            started = time.monotonic()
            response = await http.post(
                "/v1/chat/completions",
                content=b"x" * FIFTY_MB,
                headers={"content-type": "application/json"},
            )
            elapsed_s = time.monotonic() - started
        assert_413(response.status_code, response.content, limit)
        assert elapsed_s < BOUND_S  # no hang; the measured time is in the commit message
    finally:
        await stop_router(app)
