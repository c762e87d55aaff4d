"""Overload over HTTP with fake workers: slots and queue, 429 with Retry-After, waiting for KV
pages."""

from __future__ import annotations

import asyncio

import httpx

from services.common.errors import CapacityError
from services.router.config import FlowConfig
from tests.router.conftest import BOUND_S, MODEL_NAME, wait_until
from tests.router.fakes import Script
from tests.router.served import serve

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def post(http: httpx.AsyncClient, **extra) -> httpx.Response:
    return await http.post("/v1/chat/completions", json={**CHAT, **extra})


def assert_429(response: httpx.Response, message: str) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and message in error["message"], error


async def test_past_the_slots_and_the_queue_the_extra_get_429_at_once_and_the_rest_finish():
    flow = FlowConfig(max_concurrent_requests=2, max_queued_requests=3, stall_timeout_s=BOUND_S)
    async with serve(flow) as served:
        decode = served.cluster.decode
        decode.release.clear()  # the two running requests wait in decode
        tasks = [asyncio.create_task(post(served.http)) for _ in range(9)]
        try:  # four answered while decode still holds the others
            await wait_until(lambda: sum(t.done() for t in tasks) == 4)
            for task in [t for t in tasks if t.done()]:
                assert_429(task.result(), "at capacity")
            health = await served.http.get("/health")
            assert health.status_code == 200
            assert health.json()["admission"] == {
                "num_running": 2,
                "num_queued": 3,
                "max_running": 2,
                "max_queued": 3,
                "is_kv_limited": False,
            }
            assert (
                served.metric("admission_running") == 2 and served.metric("admission_queued") == 3
            )
            assert served.metric("admission_rejected_total", reason="queue_full") == 4
            decode.release.set()
            async with asyncio.timeout(BOUND_S):
                replies = await asyncio.gather(*[t for t in tasks if not t.done()])
        finally:
            decode.release.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert [r.status_code for r in replies] == [200] * 5
        assert served.metric("admission_running") == 0 and served.metric("admission_queued") == 0
        assert served.metric("admission_wait_seconds_count") == 9
        outcome = {"endpoint": "/v1/chat/completions", "outcome": "rate_limit_exceeded"}
        assert served.metric("requests_total", **outcome) == 4


async def test_a_wait_for_a_slot_past_the_limit_is_a_429():
    flow = FlowConfig(
        max_concurrent_requests=1,
        max_queued_requests=4,
        queue_timeout_s=0.3,
        stall_timeout_s=BOUND_S,
    )
    async with serve(flow) as served:
        decode = served.cluster.decode
        decode.release.clear()
        first = asyncio.create_task(post(served.http))
        try:
            await wait_until(decode.generate_started.is_set)
            assert_429(await post(served.http), "for one of 1 request slots")
            assert served.metric("admission_rejected_total", reason="queue_timeout") == 1
        finally:
            decode.release.set()
        assert (await first).status_code == 200


async def test_requests_wait_for_kv_pages_and_all_finish():
    script = Script(chunk_size=1, chunk_delay_s=0.01)
    async with serve(FlowConfig(max_concurrent_requests=16), script) as served:
        decode = served.cluster.decode
        decode.capacity = 2  # pages for two requests at a time
        async with asyncio.timeout(BOUND_S):
            replies = await asyncio.gather(*(post(served.http) for _ in range(8)))
        assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies]
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == ["Hello"] * 8
        assert decode.num_refused > 0  # they did wait for pages, not fail
        address = served.cluster.decodes[0].address
        assert served.metric("kv_refusals_total", address=address) == decode.num_refused
        assert served.metric("admission_rejected_total", reason="kv_capacity") == 0
        assert not decode.holding and served.app.pipeline.admission.snapshot().num_queued == 0


async def test_requests_refused_by_a_full_prefill_queue_wait_and_all_finish():
    """Prefill's RESOURCE_EXHAUSTED puts the request back in admission (its reservation
    aborted, not written), as a full decode does; every request ends 200."""
    script = Script(chunk_size=1, prefill_delay_s=0.05)
    async with serve(FlowConfig(max_concurrent_requests=16), script) as served:
        prefill, decode = served.cluster.prefill, served.cluster.decode
        prefill.capacity = 2
        async with asyncio.timeout(BOUND_S):
            replies = await asyncio.gather(*(post(served.http) for _ in range(8)))
        assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies]
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == ["Hello"] * 8
        assert prefill.num_refused > 0
        address = served.cluster.prefills[0].address
        assert served.metric("prefill_refusals_total", address=address) == prefill.num_refused
        assert served.metric("admission_rejected_total", reason="prefill_capacity") == 0
        # each refused reservation was aborted, unwritten, before its request reserved again
        assert len(decode.aborted) == prefill.num_refused
        assert not any(decode.is_kv_written.values())
        assert not decode.holding and served.app.pipeline.admission.snapshot().num_queued == 0


async def test_a_wait_for_room_in_prefill_past_the_limit_is_a_429():
    script = Script(prefill_error=CapacityError("prefill queue is full (256 requests)"))
    async with serve(FlowConfig(queue_timeout_s=0.3), script) as served:
        assert_429(await post(served.http), "room in prefill's queue: prefill queue is full")
        assert served.metric("admission_rejected_total", reason="prefill_capacity") == 1
        decode = served.cluster.decode
        assert decode.aborted and not decode.holding
        assert not any(decode.is_kv_written.values())  # prefill wrote nothing


async def test_a_wait_for_kv_pages_past_the_limit_is_a_429_before_the_first_byte():
    script = Script(reserve_error=CapacityError("no free KV pages"))
    async with serve(FlowConfig(queue_timeout_s=0.3), script) as served:
        assert_429(await post(served.http), "KV pages on decode: no free KV pages")
        streamed = await post(served.http, stream=True)
        assert_429(streamed, "no free KV pages")  # a plain HTTP error, not a stream
        assert served.metric("admission_rejected_total", reason="kv_capacity") == 2
        assert not served.cluster.decode.reserved
