"""Router membership with real decode worker processes found through a ``dns:///`` address:
a worker the answer gains serves within one re-resolve period, one it loses mid-stream ends
its streams with a result or a clear error (never hangs), and a worker whose health check
flaps gets requests only while the router last saw it SERVING."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from services.router.config import FlowConfig
from tests.router.conftest import BOUND_S, wait_until
from tests.router.membership import (
    DECODE_NAME,
    Discovered,
    StreamResult,
    chat,
    complete,
    discovered_router,
    read_stream,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STALL_S = 1.0
STREAM_TOKENS = 150  # the fake decode sends one every 0.02 s: a stream outlives the test's steps


async def texts(router: Discovered, num: int) -> list[str]:
    async with httpx.AsyncClient(base_url=router.url, timeout=BOUND_S) as http:
        return [await complete(http) for _ in range(num)]


async def test_a_worker_the_answer_gains_serves_within_one_re_resolve_period():
    async with discovered_router() as router:
        a, b = await router.processes.start("a", "b")
        router.resolver.answers[DECODE_NAME] = (a.address,)
        await router.refreshed()
        assert router.ready_decodes() == [a.address]
        assert await texts(router, 2) == ["Haaa", "Haaa"]

        router.resolver.answers[DECODE_NAME] = (a.address, b.address)
        await router.refreshed()  # the refresh that saw the new answer ended: b was admitted
        assert router.ready_decodes() == sorted([a.address, b.address])
        assert sorted(await texts(router, 4)) == ["Haaa", "Haaa", "Hbbb", "Hbbb"]


async def test_a_router_with_no_decode_answer_is_not_ready_until_one_comes():
    async with discovered_router() as router:
        assert not router.app.registry.is_ready  # the name answers nothing yet
        async with httpx.AsyncClient(base_url=router.url, timeout=BOUND_S) as http:
            reply = await http.post("/v1/chat/completions", json=chat(4))
            assert reply.status_code == 503, reply.text
            assert "no ready decode worker" in reply.json()["error"]["message"]
        (a,) = await router.processes.start("a")
        router.resolver.answers[DECODE_NAME] = (a.address,)
        await router.refreshed()
        assert router.app.registry.is_ready and router.app.health.is_serving
        router.resolver.error = OSError("the DNS server is down")  # the last answer stays
        await router.refreshed()
        assert router.ready_decodes() == [a.address]
        assert await texts(router, 1) == ["Haaa"]


@pytest.mark.parametrize("fate", ["stays_up", "killed", "frozen"])
async def test_a_worker_the_answer_loses_mid_stream_ends_its_streams(fate):
    flow = FlowConfig(stall_timeout_s=STALL_S)
    async with discovered_router(flow=flow) as router:
        a, b = await router.processes.start("a", "b")
        router.resolver.answers[DECODE_NAME] = (a.address, b.address)
        await router.refreshed()
        assert len(router.ready_decodes()) == 2
        results = [StreamResult() for _ in range(4)]
        async with httpx.AsyncClient(base_url=router.url, timeout=BOUND_S) as http:
            async with asyncio.TaskGroup() as streams:
                for result in results:
                    streams.create_task(_stream(http, result))
                await wait_until(lambda: all(len(r.text) >= 3 for r in results))
                router.resolver.answers[DECODE_NAME] = (a.address,)
                if fate == "killed":
                    b.signal(signal.SIGKILL)
                elif fate == "frozen":
                    b.signal(signal.SIGSTOP)
                await router.refreshed()
                assert router.ready_decodes() == [a.address]  # nothing new goes to b
                assert sorted(await _texts_on(http, 2)) == ["Haaa", "Haaa"]
        on_b = [r for r in results if r.text[1:2] == "b"]
        on_a = [r for r in results if r.text[1:2] == "a"]
        assert len(on_a) == len(on_b) == 2, [r.text for r in results]
        assert all(r.is_done for r in results)
        for result in on_a:
            assert (result.finish_reason, result.errors) == ("length", [])
            assert result.text == "H" + "a" * (STREAM_TOKENS - 1)
        for result in on_b:
            _assert_ended(result, fate)
        (leaving,) = [w for w in router.app.registry.workers() if w.address == b.address]
        assert leaving.is_leaving and leaving.num_in_flight == 0


async def _stream(http: httpx.AsyncClient, result: StreamResult) -> None:
    async with http.stream(
        "POST", "/v1/chat/completions", json=chat(STREAM_TOKENS, stream=True)
    ) as reply:
        assert reply.status_code == 200
        await read_stream(reply.aiter_lines(), result)


async def _texts_on(http: httpx.AsyncClient, num: int) -> list[str]:
    return [await complete(http) for _ in range(num)]


def _assert_ended(result: StreamResult, fate: str) -> None:
    if fate == "stays_up":  # a leaving worker that still runs finishes what it holds
        assert (result.finish_reason, result.errors) == ("length", [])
        assert result.text == "H" + "b" * (STREAM_TOKENS - 1)
        return
    assert result.finish_reason is None
    assert [e["type"] for e in result.errors] == ["service_unavailable"], result.errors
    if fate == "frozen":  # only the stall bound can tell
        assert f"the decode worker sent nothing for {STALL_S:g} s" in result.errors[0]["message"]


async def test_a_flapping_worker_gets_requests_only_while_seen_serving():
    async with discovered_router() as router:
        a, b = await router.processes.start("a", "b")
        router.resolver.answers[DECODE_NAME] = (a.address,)
        await router.refreshed()
        b.signal(signal.SIGUSR1)  # NOT_SERVING before the answer holds it
        router.resolver.answers[DECODE_NAME] = (a.address, b.address)
        await router.refreshed()
        assert router.ready_decodes() == [a.address]  # joined, not admitted
        assert await texts(router, 4) == ["Haaa"] * 4
        for _ in range(3):
            b.signal(signal.SIGUSR2)
            await wait_until(lambda: b.address in router.ready_decodes())
            assert sorted(await texts(router, 4)) == ["Haaa", "Haaa", "Hbbb", "Hbbb"]
            b.signal(signal.SIGUSR1)
            await wait_until(lambda: b.address not in router.ready_decodes())
            assert await texts(router, 4) == ["Haaa"] * 4
