"""The router as an OS process over fake workers in this process, and raw-socket clients for
the tests of its HTTP server's connection bounds (``test_http_server.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import select
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import REPO
from tests.router.conftest import BOUND_S, Cluster, read_ready

API_KEY = "sk-http-limits"
KEY_HEADER = {"authorization": f"Bearer {API_KEY}"}
HALF_OPEN_REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n"  # headers never finished


@dataclass
class RouterProcess:
    process: asyncio.subprocess.Process
    http_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    def log_bytes(self) -> int:
        return self.log_path.stat().st_size


@contextlib.asynccontextmanager
async def router_process(
    cluster: Cluster, log_path: Path, *flags: str, fd_limit: int | None = None
) -> AsyncIterator[RouterProcess]:
    """``python -m services.router`` with the API key ``API_KEY`` and ``flags``, its stderr in
    ``log_path``; ``fd_limit``: its RLIMIT_NOFILE (soft and hard). Killed on exit."""

    def limit_fds() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.router",
            *("--port", "0", "--http-port", "0", "--metrics-port", "0"),
            *("--tokenizer-address", cluster.tokenizer.address),
            *("--prefill-address", cluster.prefills[0].address),
            *("--decode-address", cluster.decodes[0].address),
            *flags,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env={**os.environ, "STAGESERVE_API_KEY": API_KEY},
            preexec_fn=limit_fds,
        )
    try:
        ready = await read_ready(process, "router")
        yield RouterProcess(process, int(ready["http_port"]), log_path)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


def raise_fd_limit(num_fds: int) -> None:
    """This process's soft RLIMIT_NOFILE raised to hold ``num_fds`` more sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = num_fds + 256
    if soft < wanted:
        assert hard == resource.RLIM_INFINITY or hard >= wanted, f"RLIMIT_NOFILE hard {hard}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def open_half_open(port: int, num_connections: int) -> list[socket.socket]:
    """``num_connections`` connections that each sent an unfinished request head."""
    socks = []
    try:
        for _ in range(num_connections):
            sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
            sock.sendall(HALF_OPEN_REQUEST)
            socks.append(sock)
    except BaseException:
        close_all(socks)
        raise
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def read_until_closed(sock: socket.socket, timeout_s: float = BOUND_S) -> bytes:
    """Everything the server sends until it closes (b"" cut short by a reset)."""
    chunks = []
    deadline_mono = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    with contextlib.suppress(ConnectionResetError):
        while time.monotonic() < deadline_mono:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    return b"".join(chunks)


def num_closed_by_server(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has closed (EOF, reset, or a whole reply then EOF)."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    num_closed = 0
    for fd, _ in poller.poll(0):
        try:
            data = by_fd[fd].recv(65536, socket.MSG_PEEK)
        except ConnectionResetError:
            num_closed += 1
            continue
        if not data or b"\r\n\r\n" in data:
            num_closed += 1
    return num_closed


async def probe(router: RouterProcess) -> tuple[int, float]:
    """``GET /v1/models`` with the key on a new connection: its status and seconds taken."""
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=router.url, timeout=BOUND_S) as http:
        reply = await http.get("/v1/models", headers=KEY_HEADER)
    return reply.status_code, time.monotonic() - start
