"""Helpers of the membership tests: a resolver whose answer the test sets, fake decode worker
processes, and a router (in this process, over HTTP) that discovers its decode workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client import CollectorRegistry

from services.router.app import RouterApp
from services.router.config import RouterConfig
from services.router.discovery import BaseResolver
from services.router.metrics import RouterMetrics
from services.router.workers import DnsName, WorkerKind
from tests.conftest import REPO
from tests.router.conftest import MODEL_NAME, Cluster, read_ready, router_config, stop_router
from tests.router.fakes import FakePrefill, FakeTokenizer, FakeWorker, Script, start_worker

DECODE_NAME = "decode.stageserve.test"
DECODE_TARGET = f"dns:///{DECODE_NAME}:50051"
DISCOVERY_INTERVAL_S = 0.2


class ScriptedResolver(BaseResolver):
    """Answers what the test put in ``answers`` (by host name); ``error`` fails every lookup."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[str, ...]] = {}
        self.error: OSError | None = None
        self.num_calls = 0

    async def resolve(self, name: DnsName) -> tuple[str, ...]:
        self.num_calls += 1
        if self.error is not None:
            raise self.error
        return self.answers.get(name.host, ())


@dataclass
class DecodeProcess:
    """``python -m tests.router.fake_decode LETTER``: it generates LETTER over and over."""

    letter: str
    process: asyncio.subprocess.Process
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)


@dataclass
class Processes:
    started: list[DecodeProcess] = field(default_factory=list)

    async def start(self, *letters: str) -> list[DecodeProcess]:
        return list(await asyncio.gather(*(self._start(letter) for letter in letters)))

    async def _start(self, letter: str) -> DecodeProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.router.fake_decode",
            letter,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        decode = DecodeProcess(letter, process, 0)
        self.started.append(decode)
        decode.port = int((await read_ready(process, "decode"))["port"])
        return decode

    async def kill_all(self) -> None:
        for decode in self.started:
            if decode.process.returncode is None:
                decode.signal(signal.SIGCONT)
                decode.process.kill()
            await decode.process.wait()


@dataclass
class Discovered:
    app: RouterApp
    url: str
    resolver: ScriptedResolver
    processes: Processes

    async def refreshed(self, num: int = 2) -> None:
        """Wait until ``num`` more discovery refreshes have completed (2: one of them started
        after this call, so it saw the resolver's current answer)."""
        target = self.app.discovery.num_refreshes + num
        async with asyncio.timeout(10 * num * DISCOVERY_INTERVAL_S + 10):
            while self.app.discovery.num_refreshes < target:
                await asyncio.sleep(DISCOVERY_INTERVAL_S / 4)

    def ready_decodes(self) -> list[str]:
        return sorted(w.address for w in self.app.registry.ready_workers(WorkerKind.DECODE))


def discovery_config(tokenizer: FakeWorker, prefill: FakeWorker, **overrides) -> RouterConfig:
    """``router_config`` with the decode workers at ``DECODE_TARGET``, no health-check
    generate (its traffic would take turns of the round-robin the tests count)."""
    cfg = router_config(Cluster(Script(), tokenizer, [prefill], []))
    workers = replace(
        cfg.workers, decode=(DECODE_TARGET,), discovery_interval_s=DISCOVERY_INTERVAL_S
    )
    return replace(cfg, workers=workers, health_generate_interval_s=0.0, **overrides)


@contextlib.asynccontextmanager
async def discovered_router(answer: tuple[str, ...] = (), **overrides) -> AsyncIterator[Discovered]:
    """A router over a fake tokenizer and prefill (in this process) that finds its decode
    workers at ``DECODE_TARGET`` through a ``ScriptedResolver`` answering ``answer`` at first;
    every decode process started through ``processes`` is killed on exit."""
    from services.router.__main__ import bind_http_socket

    script = Script()
    tokenizer = await start_worker(FakeTokenizer(script))
    prefill = await start_worker(FakePrefill(script))
    resolver, processes = ScriptedResolver(), Processes()
    resolver.answers[DECODE_NAME] = answer
    app = None
    try:
        cfg = discovery_config(tokenizer, prefill, **overrides)
        app = RouterApp.build(cfg, RouterMetrics(CollectorRegistry()), resolver=resolver)
        sock = bind_http_socket("127.0.0.1", 0)
        await app.start(sock)
        yield Discovered(app, f"http://127.0.0.1:{sock.getsockname()[1]}", resolver, processes)
    finally:
        if app is not None:
            await stop_router(app)
        await processes.kill_all()
        await tokenizer.server.stop(None)
        await prefill.server.stop(None)


def chat(max_tokens: int, *, stream: bool = False) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def complete(http: httpx.AsyncClient, max_tokens: int = 4) -> str:
    """One chat completion's text (the first letter from prefill, the rest from decode)."""
    reply = await http.post("/v1/chat/completions", json=chat(max_tokens))
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    is_done: bool = False  # "data: [DONE]" came


async def read_stream(lines: AsyncIterator[str], result: StreamResult) -> None:
    """Read SSE ``lines`` to their end into ``result``."""
    async for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            result.is_done = True
            continue
        event = json.loads(line[6:])
        if "error" in event:
            result.errors.append(event["error"])
            continue
        choice = event["choices"][0]
        result.text += choice["delta"].get("content") or ""
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
