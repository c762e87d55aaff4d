"""SIGTERM to a router process with streams in flight: it reports not ready, refuses new
requests with an OpenAI-style 503, lets the streams finish (or ends them with the drain
budget's error), and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import BOUND_S, MODEL_NAME, Cluster, wait_until
from tests.router.fakes import EOS_ID, Script, char_ids
from tests.router.http_helpers import sse_events
from tests.router.router_process import KEY_HEADER, RouterProcess, router_process

NUM_STREAMS = 8
NUM_TOKENS = 40
SLOW_CHUNK_S = 1.0  # between decode messages: 20 messages outlast every check below
COMPLETION = {"model": MODEL_NAME, "prompt": "Say hello.", "max_tokens": 64, "stream": True}


@pytest.fixture
def script() -> Script:
    return Script(output_ids=[*char_ids("x" * NUM_TOKENS), EOS_ID], chunk_delay_s=SLOW_CHUNK_S)


class Streams:
    """``NUM_STREAMS`` streaming completions; each records its events as they arrive."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.events: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
        self.tasks = [asyncio.create_task(self._run(http, i)) for i in range(NUM_STREAMS)]

    async def _run(self, http: httpx.AsyncClient, index: int) -> int:
        async with http.stream("POST", "/v1/completions", json=COMPLETION) as response:
            async for chunk in response.aiter_text():
                self.events[index] += sse_events(chunk)
            return response.status_code

    def all_streaming(self) -> bool:
        return all(len(events) >= 1 for events in self.events)

    async def finish(self) -> list[int]:
        async with asyncio.timeout(BOUND_S):
            return await asyncio.gather(*self.tasks)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def wait_exit(router: RouterProcess) -> int:
    async with asyncio.timeout(BOUND_S):
        return await router.process.wait()


async def start_streams(router: RouterProcess, http: httpx.AsyncClient) -> Streams:
    streams = Streams(http)
    await wait_until(streams.all_streaming)
    router.process.send_signal(signal.SIGTERM)
    await wait_until_draining(http)
    return streams


async def wait_until_draining(http: httpx.AsyncClient) -> None:
    async with asyncio.timeout(BOUND_S):
        while (await http.get("/health")).status_code != 503:
            await asyncio.sleep(0.05)


async def test_sigterm_finishes_the_streams_refuses_new_ones_and_exits_0(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with (
        router_process(cluster, tmp_path / "router.log") as router,
        httpx.AsyncClient(base_url=router.url, headers=KEY_HEADER, timeout=BOUND_S) as http,
    ):
        streams = await start_streams(router, http)
        try:
            health = await http.get("/health")
            assert health.json()["status"] == "draining"
            refused = await http.post("/v1/completions", json={**COMPLETION, "stream": False})
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable"
            assert "shutting down" in error["message"]
            assert router.process.returncode is None
            cluster.script.chunk_delay_s = 0.0
            statuses = await streams.finish()
        finally:
            streams.cancel()
        assert await wait_exit(router) == 0
    assert statuses == [200] * NUM_STREAMS
    for events in streams.events:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert "".join(c["choices"][0]["text"] for c in chunks) == "x" * NUM_TOKENS
    assert "draining: 8 requests in flight" in (tmp_path / "router.log").read_text()


async def test_streams_past_the_drain_budget_get_its_error_and_are_aborted(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.decode.hang_after = 1
    log = tmp_path / "router.log"
    async with (
        router_process(cluster, log, "--drain-timeout-s", "1") as router,
        httpx.AsyncClient(base_url=router.url, headers=KEY_HEADER, timeout=BOUND_S) as http,
    ):
        streams = await start_streams(router, http)
        try:
            statuses = await streams.finish()
        finally:
            streams.cancel()
        assert await wait_exit(router) == 0
    assert statuses == [200] * NUM_STREAMS
    for events in streams.events:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable", error
        assert "drain budget of 1 s" in error["message"]
    await wait_until(lambda: len(cluster.aborted()) == NUM_STREAMS)
