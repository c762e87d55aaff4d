"""The router's HTTP server bounds (``services/router/http_server.py``), against a router
process: half-open connections, the connection limit, oversized heads, stalled bodies, idle
keep-alive, pipelining and HTTP/1.0 streams."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import INTERNAL_AUTH
from tests.router.conftest import BOUND_S, MODEL_NAME, Cluster, start_cluster
from tests.router.fakes import Script
from tests.router.router_process import (
    API_KEY,
    RouterProcess,
    close_all,
    num_closed_by_server,
    open_half_open,
    probe,
    raise_fd_limit,
    read_until_closed,
    router_process,
)

pytestmark = pytest.mark.integration

NUM_HALF_OPEN = 2000
MAX_LOG_BYTES = 1024 * 1024
MAX_RSS_GROWTH = 50 * 1024 * 1024
PROBE_BOUND_S = 5.0


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    cluster = await start_cluster(Script(), auth=INTERNAL_AUTH)
    yield cluster
    await cluster.stop()


async def wait_all_closed(socks: list[socket.socket]) -> None:
    deadline_mono = time.monotonic() + BOUND_S
    while num_closed_by_server(socks) < len(socks):
        assert time.monotonic() < deadline_mono, (
            f"{num_closed_by_server(socks)}/{len(socks)} closed"
        )
        await asyncio.sleep(0.1)


def replies(socks: list[socket.socket]) -> list[bytes]:
    return [read_until_closed(sock, timeout_s=1.0) for sock in socks]


async def assert_probes_answered(router: RouterProcess, num_probes: int = 3) -> None:
    for _ in range(num_probes):
        status, seconds = await probe(router)
        assert status == 200 and seconds < PROBE_BOUND_S, (status, seconds)


async def test_half_open_connections_leave_the_api_answering(cluster, tmp_path: Path):
    raise_fd_limit(NUM_HALF_OPEN)
    async with router_process(
        cluster, tmp_path / "router.log", "--http-header-timeout-s", "1"
    ) as r:
        socks = await asyncio.to_thread(open_half_open, r.http_port, NUM_HALF_OPEN)
        try:
            await assert_probes_answered(r)
            await wait_all_closed(socks)  # by the header timeout
            answers = await asyncio.to_thread(replies, socks)
        finally:
            close_all(socks)
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers if a), set(answers)
        await assert_probes_answered(r)
        assert r.log_bytes() < MAX_LOG_BYTES


@pytest.mark.parametrize(("fd_limit", "max_connections"), [(None, 500), (1024, 256)])
async def test_connections_past_the_limit_get_503_and_fds_never_run_out(
    cluster, tmp_path: Path, fd_limit: int | None, max_connections: int
):
    """Past --http-max-connections (500, or the 256 that RLIMIT_NOFILE 1024 leaves), a
    connection gets 503 with Retry-After at once; the held ones go at the header timeout."""
    raise_fd_limit(NUM_HALF_OPEN)
    flags = ["--http-header-timeout-s", "3"]
    if fd_limit is None:
        flags += ["--http-max-connections", str(max_connections)]
    log = tmp_path / "router.log"
    async with router_process(cluster, log, *flags, fd_limit=fd_limit) as r:
        socks = await asyncio.to_thread(open_half_open, r.http_port, NUM_HALF_OPEN)
        try:
            status, seconds = await probe(r)
            assert status in (200, 503) and seconds < PROBE_BOUND_S, (status, seconds)
            await wait_all_closed(socks)
            answers = await asyncio.to_thread(replies, socks)
        finally:
            close_all(socks)
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
        held = [a for a in answers if a.startswith(b"HTTP/1.1 408 ")]
        assert len(refused) + len(held) == NUM_HALF_OPEN
        assert len(held) <= max_connections and len(refused) >= NUM_HALF_OPEN // 2
        head, _, body = refused[0].partition(b"\r\n\r\n")
        assert b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        await assert_probes_answered(r)
        assert r.log_bytes() < MAX_LOG_BYTES
        text = log.read_text()
        assert "out of system resource" not in text
        if fd_limit is not None:
            assert f"--http-max-connections 4096 lowered to {max_connections}" in text


def send_head_until_reply(port: int, head: bytes, piece_bytes: int = 64 * 1024) -> bytes:
    """Sends ``head`` in pieces, stopping at the server's first reply; that reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        for start in range(0, len(head), piece_bytes):
            try:
                sock.sendall(head[start : start + piece_bytes])
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        sock.settimeout(BOUND_S)
        return read_until_closed(sock)


def big_head(num_fields: int, value_bytes: int) -> bytes:
    line = b"X-Filler-%08d: " + b"v" * value_bytes + b"\r\n"
    lines = b"".join(line % i for i in range(num_fields))
    return b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n"


async def test_64_mb_header_blocks_get_431_without_memory_growth(cluster, tmp_path: Path):
    head = big_head(64 * 1024 * 1024 // 8000, value_bytes=8000)  # 64 MB
    async with router_process(cluster, tmp_path / "router.log") as r:
        rss_before = peak = r.rss_bytes()
        answers: list[bytes] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(send_head_until_reply(r.http_port, head))
            )
            for _ in range(16)
        ]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            peak = max(peak, r.rss_bytes())
            await asyncio.sleep(0.02)
        assert len(answers) == 16
        assert all(a.startswith(b"HTTP/1.1 431 ") for a in answers), {a[:40] for a in answers}
        body = json.loads(answers[0].partition(b"\r\n\r\n")[2])
        assert (
            body["error"]["message"] == "the request head is larger than the limit of 65536 bytes"
        )
        assert peak - rss_before < MAX_RSS_GROWTH, (rss_before, peak)
        await assert_probes_answered(r, 1)


async def test_too_many_header_fields_get_431(cluster, tmp_path: Path):
    async with router_process(cluster, tmp_path / "router.log", "--http-max-headers", "20") as r:
        head = big_head(20, value_bytes=10)  # and Host: 21 fields
        answer = await asyncio.to_thread(send_head_until_reply, r.http_port, head)
        assert answer.startswith(b"HTTP/1.1 431 ")
        body = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_header_fields_too_large"
        assert "more than the limit of 20 header fields" in body["error"]["message"]


def post_request(body: dict, path: str = "/v1/chat/completions", version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/{version}\r\nHost: x\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
TOKENIZE = {"model": MODEL_NAME, "prompt": "hello there"}


async def test_a_stalled_body_is_closed_a_slow_one_is_served(cluster, tmp_path: Path):
    flags = ("--http-body-timeout-s", "2", "--http-keep-alive-timeout-s", "1")
    async with router_process(cluster, tmp_path / "router.log", *flags) as r:
        request = post_request(TOKENIZE, "/tokenize")
        with socket.create_connection(("127.0.0.1", r.http_port), timeout=BOUND_S) as sock:
            sock.sendall(request[:-10])  # headers and most of the body, then nothing
            answer = await asyncio.to_thread(read_until_closed, sock)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
        assert b"no request body arrived for 2.0 s" in answer
        with socket.create_connection(("127.0.0.1", r.http_port), timeout=BOUND_S) as sock:
            head_len = request.index(b"\r\n\r\n") + 4
            sock.sendall(request[:head_len])
            for start in range(head_len, len(request), 8):  # each gap well under the timeout
                await asyncio.sleep(0.1)
                sock.sendall(request[start : start + 8])
            answer = await asyncio.to_thread(read_until_closed, sock)  # the idle close
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


async def test_keep_alive_pipelining_and_idle_close(cluster, tmp_path: Path):
    flags = ("--http-keep-alive-timeout-s", "1", "--http-header-timeout-s", "3")
    async with router_process(cluster, tmp_path / "router.log", *flags) as r:
        models = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", r.http_port), timeout=BOUND_S) as sock:
            tokenize = post_request(TOKENIZE, "/tokenize")
            sock.sendall(tokenize + models.encode() * 2)  # three pipelined requests
            answer = await asyncio.to_thread(read_until_closed, sock)  # until the idle close
        assert answer.count(b"HTTP/1.1 200 OK\r\n") == 3, answer
        assert answer.count(b'"tokens":') == 1 and answer.count(MODEL_NAME.encode()) >= 2
        assert b"HTTP/1.1 408" not in answer  # an idle connection closes without a reply


async def test_http10_stream_is_close_delimited(cluster, tmp_path: Path):
    async with router_process(cluster, tmp_path / "router.log") as r:
        with socket.create_connection(("127.0.0.1", r.http_port), timeout=BOUND_S) as sock:
            sock.sendall(post_request({**CHAT, "stream": True}, version="1.0"))
            answer = await asyncio.to_thread(read_until_closed, sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = head.decode().lower().split("\r\n")
        assert lines[0] == "http/1.1 200 ok"
        assert "connection: close" in lines
        assert not any(line.startswith(("transfer-encoding", "content-length")) for line in lines)
        events = [e for e in body.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), events
        assert events[-1] == "data: [DONE]"
        text = "".join(
            json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1]
        )
        assert text == "Hello"
        with socket.create_connection(("127.0.0.1", r.http_port), timeout=BOUND_S) as sock:
            sock.sendall(post_request(CHAT, version="1.0"))
            answer = await asyncio.to_thread(read_until_closed, sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert f"content-length: {len(body)}".encode() in head.lower()
        assert json.loads(body)["choices"][0]["message"]["content"] == "Hello"
