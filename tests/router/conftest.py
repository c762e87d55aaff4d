"""A router wired to fake tokenizer/prefill/decode workers (real gRPC, in this event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common.auth import Credentials
from services.router.app import RouterApp
from services.router.auth import RouterAccess
from services.router.config import LimitsConfig, PolicyName, RouterConfig, WorkerAddresses
from services.router.images import ImageLoader
from services.router.metrics import RouterMetrics
from tests.conftest import INTERNAL_AUTH, REPO, TINY_MODEL_DIR
from tests.router.fake_decode import FakeDecode
from tests.router.fakes import (
    FakePrefill,
    FakeTokenizer,
    FakeWorker,
    Script,
    start_worker,
)

MODEL_NAME = "tiny-qwen2.5-vl"
BOUND_S = 30.0  # generous bound on anything that should happen "promptly"
READY_TIMEOUT_S = 120  # a worker process's start, up to its READY line


@dataclass
class Cluster:
    script: Script
    tokenizer: FakeWorker
    prefills: list[FakeWorker]
    decodes: list[FakeWorker]

    @property
    def decode(self) -> FakeDecode:
        return self.decodes[0].servicer

    @property
    def prefill(self) -> FakePrefill:
        return self.prefills[0].servicer

    def aborted(self) -> list[str]:
        return [rid for d in self.decodes for rid in d.servicer.aborted]

    def is_kv_written(self) -> dict[str, bool]:
        """What each Abort said in is_kv_written, by request id."""
        return {rid: flag for d in self.decodes for rid, flag in d.servicer.is_kv_written.items()}

    async def stop(self) -> None:
        for worker in [self.tokenizer, *self.prefills, *self.decodes]:
            if getattr(worker.servicer, "stopping", None) is not None:
                await worker.servicer.stopping
            await worker.server.stop(None)


async def start_cluster(
    script: Script, num_prefills: int = 1, num_decodes: int = 1, auth: Credentials | None = None
) -> Cluster:
    """Fake workers; ``auth``: the internal token they require (None: none)."""
    tokenizer = await start_worker(FakeTokenizer(script), auth)
    prefills = [await start_worker(FakePrefill(script), auth) for _ in range(num_prefills)]
    decodes = [await start_worker(FakeDecode(script), auth) for _ in range(num_decodes)]
    return Cluster(script, tokenizer, prefills, decodes)


def router_config(cluster: Cluster, **overrides) -> RouterConfig:
    cfg = RouterConfig(
        model=TINY_MODEL_DIR,
        served_model_name=MODEL_NAME,
        max_context_len=4096,
        workers=WorkerAddresses(
            tokenizer=(cluster.tokenizer.address,),
            prefill=tuple(w.address for w in cluster.prefills),
            decode=tuple(w.address for w in cluster.decodes),
        ),
        limits=LimitsConfig(request_timeout_s=BOUND_S, max_image_bytes=64 * 1024),
        health_interval_s=0.1,
        health_timeout_s=1.0,
        policy=PolicyName.ROUND_ROBIN,
        http_port=0,
    )
    return replace(cfg, **overrides)


async def read_ready(process: asyncio.subprocess.Process, name: str) -> dict[str, str]:
    assert process.stdout is not None
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            line = (await process.stdout.readline()).decode()
            assert line, f"{name} exited before READY"
            words = line.split()
            if words[:2] == ["READY", name]:
                return dict(w.split("=", 1) for w in words[2:])


@dataclass
class ProcessCluster:
    """Fake tokenizer and prefill in this process, the fake decode a process of its own."""

    script: Script
    tokenizer: FakeWorker
    prefill: FakeWorker
    decode: asyncio.subprocess.Process
    decode_port: str

    def router_config(self, **overrides) -> RouterConfig:
        """``router_config`` for these workers, decode at the process's port."""
        cfg = router_config(Cluster(self.script, self.tokenizer, [self.prefill], []), **overrides)
        decode = (f"127.0.0.1:{self.decode_port}",)
        return replace(cfg, workers=replace(cfg.workers, decode=decode))


@contextlib.asynccontextmanager
async def process_cluster() -> AsyncIterator[ProcessCluster]:
    """A ``ProcessCluster`` once its decode is READY; the decode is killed (resumed first if
    stopped) and every worker stopped on exit."""
    script = Script()
    tokenizer = await start_worker(FakeTokenizer(script))
    prefill = await start_worker(FakePrefill(script))
    decode = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.router.fake_decode",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        decode_port = (await read_ready(decode, "decode"))["port"]
        yield ProcessCluster(script, tokenizer, prefill, decode, decode_port)
    finally:
        if decode.returncode is None:
            decode.send_signal(signal.SIGCONT)
            decode.kill()
        await decode.wait()
        await tokenizer.server.stop(None)
        await prefill.server.stop(None)


async def start_router(
    cfg: RouterConfig,
    images: ImageLoader | None = None,
    access: RouterAccess | None = None,
    *,
    wait_ready: bool = True,
) -> RouterApp:
    """A started router; ``wait_ready``: return once every kind has a ready worker (the
    first health poll can miss a worker whose port a closed test's channel still backs off
    from)."""
    app = RouterApp.build(cfg, RouterMetrics(CollectorRegistry()), images, access)
    await app.start(None)
    if wait_ready:
        await wait_until(lambda: app.registry.is_ready)
    return app


async def serve_http(cfg: RouterConfig) -> tuple[RouterApp, str]:
    """A router with its uvicorn server on a free port, once every kind has a ready worker;
    returns it and its base URL."""
    from services.router.__main__ import bind_http_socket

    app = RouterApp.build(cfg, RouterMetrics(CollectorRegistry()))
    sock = bind_http_socket("127.0.0.1", 0)
    await app.start(sock)
    await wait_until(lambda: app.registry.is_ready)
    return app, f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def asgi_client(app: RouterApp) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client into ``app``'s ASGI app (no server, no socket)."""
    transport = httpx.ASGITransport(app=app.http_app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://router", timeout=BOUND_S
    ) as client:
        yield client


async def stop_router(app: RouterApp) -> None:
    await app.grpc_server.stop(None)
    await app.stop()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = BOUND_S) -> None:
    deadline_mono = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_mono, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
async def cluster(script: Script) -> AsyncIterator[Cluster]:
    cluster = await start_cluster(script)
    yield cluster
    await cluster.stop()


@pytest.fixture
async def secured_cluster() -> AsyncIterator[Cluster]:
    """Fake workers that require the test session's internal token (``INTERNAL_AUTH``)."""
    cluster = await start_cluster(Script(), auth=INTERNAL_AUTH)
    yield cluster
    await cluster.stop()


@pytest.fixture
async def router(cluster: Cluster) -> AsyncIterator[RouterApp]:
    app = await start_router(router_config(cluster))
    yield app
    await stop_router(app)


@pytest.fixture
async def http(router: RouterApp) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(router) as client:
        yield client
