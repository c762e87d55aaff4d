"""One retry on another worker: a prefill that failed UNAVAILABLE or stalled before it wrote,
and a Reserve that failed UNAVAILABLE or stalled; none for other errors or with one worker."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from services.common.errors import InvalidRequestError, UnavailableError
from services.router.app import RouterApp
from services.router.config import FlowConfig
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    Cluster,
    router_config,
    start_cluster,
    start_router,
    stop_router,
    wait_until,
)
from tests.router.fakes import Script

STALL_S = 1.0
EXPECTED = "Hello there, world!"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Served:
    cluster: Cluster
    app: RouterApp
    http: httpx.AsyncClient

    def retries(self, kind: str) -> float:
        registry = self.app.metrics.registry
        return registry.get_sample_value("stageserve_router_worker_retries_total", {"kind": kind}) or 0.0

    async def chat(self) -> httpx.Response:
        return await self.http.post("/v1/chat/completions", json=CHAT)


@contextlib.asynccontextmanager
async def serve(num_prefills: int = 1, num_decodes: int = 1) -> AsyncIterator[Served]:
    cluster = await start_cluster(Script(), num_prefills, num_decodes)
    app = await start_router(router_config(cluster, flow=FlowConfig(stall_timeout_s=STALL_S)))
    transport = httpx.ASGITransport(app=app.http_app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=BOUND_S) as http:
            yield Served(cluster, app, http)
    finally:
        await stop_router(app)
        await cluster.stop()


def answered(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def test_an_unavailable_prefill_is_retried_on_another_on_fresh_pages():
    async with serve(num_prefills=2) as served:
        first, second = (w.servicer for w in served.cluster.prefills)
        first.error = UnavailableError("decode's transfer engine is unreachable")  # round-robin tries it first
        assert answered(await served.chat()) == EXPECTED
        assert len(first.requests) == 1 and len(second.requests) == 1
        request_id = second.requests[0].request_id
        # the first reservation was aborted as unwritten (quarantined), then decode reserved again
        assert served.cluster.is_kv_written() == {request_id: False}
        assert request_id in served.cluster.decode.reserved
        assert served.retries("prefill") == 1


async def test_a_stalled_prefill_is_retried_on_another():
    async with serve(num_prefills=2) as served:
        first, second = (w.servicer for w in served.cluster.prefills)
        first.hang = True
        started = time.monotonic()
        assert answered(await served.chat()) == EXPECTED
        assert time.monotonic() - started < STALL_S + 1.0
        request_id = second.requests[0].request_id
        await wait_until(lambda: first.cancelled == [request_id])
        assert served.cluster.is_kv_written() == {request_id: False}
        assert served.retries("prefill") == 1


async def test_prefill_is_retried_once_only():
    async with serve(num_prefills=3) as served:
        prefills = [w.servicer for w in served.cluster.prefills]
        for prefill in prefills:
            prefill.error = UnavailableError("the KV write failed")
        response = await served.chat()
        assert response.status_code == 503
        assert sorted(len(p.requests) for p in prefills) == [0, 1, 1]
        assert served.retries("prefill") == 1
        request_id = next(iter(served.cluster.decode.reserved))
        await wait_until(lambda: served.cluster.is_kv_written() == {request_id: False})


async def test_no_prefill_retry_with_one_worker_or_for_bad_input():
    async with serve(num_prefills=1) as served:
        served.cluster.prefill.error = UnavailableError("the KV write failed")
        assert (await served.chat()).status_code == 503
        assert len(served.cluster.prefill.requests) == 1
    async with serve(num_prefills=2) as served:
        first, second = (w.servicer for w in served.cluster.prefills)
        first.error = InvalidRequestError("the image cannot be decoded", param="messages")
        assert (await served.chat()).status_code == 400
        assert len(first.requests) == 1 and not second.requests
        assert served.retries("prefill") == 0


async def test_an_unavailable_reserve_is_retried_on_another_decode():
    async with serve(num_decodes=2) as served:
        first, second = (w.servicer for w in served.cluster.decodes)
        first.reserve_errors = [UnavailableError("decode is restarting")]
        assert answered(await served.chat()) == EXPECTED
        [request_id] = second.reserved
        await wait_until(lambda: first.is_kv_written == {request_id: False})  # in case it had reserved
        assert not second.aborted  # decode finished the request itself
        assert served.retries("decode") == 1


async def test_a_stalled_reserve_is_retried_on_another_decode():
    async with serve(num_decodes=2) as served:
        first, second = (w.servicer for w in served.cluster.decodes)
        first.hang_reserve = True
        assert answered(await served.chat()) == EXPECTED
        [request_id] = second.reserved
        await wait_until(lambda: first.cancelled == [request_id])
        assert served.retries("decode") == 1


async def test_reserve_is_retried_once_only_and_not_with_one_decode():
    async with serve(num_decodes=3) as served:
        decodes = [w.servicer for w in served.cluster.decodes]
        for decode in decodes:
            decode.reserve_errors = [UnavailableError("decode is restarting")]
        assert (await served.chat()).status_code == 503
        assert sorted(len(d.reserve_errors) for d in decodes) == [0, 0, 1]  # two tried
    async with serve(num_decodes=1) as served:
        served.cluster.decode.reserve_errors = [UnavailableError("decode is restarting")]
        assert (await served.chat()).status_code == 503
        assert served.retries("decode") == 0


async def test_a_decode_out_of_pages_gives_way_to_one_with_pages():
    async with serve(num_decodes=2) as served:
        first, second = (w.servicer for w in served.cluster.decodes)
        first.capacity = 0
        for _ in range(2):
            assert answered(await served.chat()) == EXPECTED
        assert first.num_refused >= 1 and not first.reserved and len(second.reserved) == 2
        assert served.retries("decode") == 0  # not a failure: the normal path under load
