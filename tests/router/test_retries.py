"""One retry on another worker: a prefill that failed UNAVAILABLE or stalled before it wrote,
and a Reserve that failed UNAVAILABLE or stalled; none for other errors or with one worker."""

from __future__ import annotations

import contextlib
import time

import httpx

from services.common.errors import InvalidRequestError, UnavailableError
from services.router.config import FlowConfig
from tests.router.conftest import MODEL_NAME, wait_until
from tests.router.fakes import Script
from tests.router.served import Served
from tests.router.served import serve as serve_flow

STALL_S = 1.0
RETRIED_WITHIN_S = STALL_S + 10.0  # generous, and far inside the request deadline (BOUND_S)
EXPECTED = "Hello there, world!"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


def retries(served: Served, kind: str) -> float:
    return served.metric("worker_retries_total", kind=kind)


async def chat(served: Served) -> httpx.Response:
    return await served.http.post("/v1/chat/completions", json=CHAT)


def serve(
    num_prefills: int = 1, num_decodes: int = 1
) -> contextlib.AbstractAsyncContextManager[Served]:
    return serve_flow(FlowConfig(stall_timeout_s=STALL_S), Script(), num_prefills, num_decodes)


def answered(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def test_an_unavailable_prefill_is_retried_on_another_on_fresh_pages():
    async with serve(num_prefills=2) as served:
        first, second = (w.servicer for w in served.cluster.prefills)
        first.error = UnavailableError("decode's transfer engine is unreachable")  # tried first
        assert answered(await chat(served)) == EXPECTED
        assert len(first.requests) == 1 and len(second.requests) == 1
        request_id = second.requests[0].request_id
        # the first reservation was aborted as unwritten (quarantined), then decode reserved again
        assert served.cluster.is_kv_written() == {request_id: False}
        assert request_id in served.cluster.decode.reserved
        assert retries(served, "prefill") == 1


async def test_a_stalled_prefill_is_retried_on_another():
    async with serve(num_prefills=2) as served:
        first, second = (w.servicer for w in served.cluster.prefills)
        first.hang = True
        started = time.monotonic()
        assert answered(await chat(served)) == EXPECTED
        assert STALL_S <= time.monotonic() - started < RETRIED_WITHIN_S
        request_id = second.requests[0].request_id
        await wait_until(lambda: first.cancelled == [request_id])
        assert served.cluster.is_kv_written() == {request_id: False}
        assert retries(served, "prefill") == 1


async def test_prefill_is_retried_once_only():
    async with serve(num_prefills=3) as served:
        prefills = [w.servicer for w in served.cluster.prefills]
        for prefill in prefills:
            prefill.error = UnavailableError("the KV write failed")
        response = await chat(served)
        assert response.status_code == 503
        assert sorted(len(p.requests) for p in prefills) == [0, 1, 1]
        assert retries(served, "prefill") == 1
        request_id = next(iter(served.cluster.decode.reserved))
        await wait_until(lambda: served.cluster.is_kv_written() == {request_id: False})


async def test_no_prefill_retry_with_one_worker_or_for_bad_input():
    async with serve(num_prefills=1) as served:
        served.cluster.prefill.error = UnavailableError("the KV write failed")
        assert (await chat(served)).status_code == 503
        assert len(served.cluster.prefill.requests) == 1
    async with serve(num_prefills=2) as served:
        first, second = (w.servicer for w in served.cluster.prefills)
        first.error = InvalidRequestError("the image cannot be decoded", param="messages")
        assert (await chat(served)).status_code == 400
        assert len(first.requests) == 1 and not second.requests
        assert retries(served, "prefill") == 0


async def test_an_unavailable_reserve_is_retried_on_another_decode():
    async with serve(num_decodes=2) as served:
        first, second = (w.servicer for w in served.cluster.decodes)
        first.reserve_errors = [UnavailableError("decode is restarting")]
        assert answered(await chat(served)) == EXPECTED
        [request_id] = second.reserved
        await wait_until(
            lambda: first.is_kv_written == {request_id: False}
        )  # in case it had reserved
        assert not second.aborted  # decode finished the request itself
        assert retries(served, "decode") == 1


async def test_a_stalled_reserve_is_retried_on_another_decode():
    async with serve(num_decodes=2) as served:
        first, second = (w.servicer for w in served.cluster.decodes)
        first.hang_reserve = True
        assert answered(await chat(served)) == EXPECTED
        [request_id] = second.reserved
        await wait_until(lambda: first.cancelled == [request_id])
        assert retries(served, "decode") == 1


async def test_reserve_is_retried_once_only_and_not_with_one_decode():
    async with serve(num_decodes=3) as served:
        decodes = [w.servicer for w in served.cluster.decodes]
        for decode in decodes:
            decode.reserve_errors = [UnavailableError("decode is restarting")]
        assert (await chat(served)).status_code == 503
        assert sorted(len(d.reserve_errors) for d in decodes) == [0, 0, 1]  # two tried
    async with serve(num_decodes=1) as served:
        served.cluster.decode.reserve_errors = [UnavailableError("decode is restarting")]
        assert (await chat(served)).status_code == 503
        assert retries(served, "decode") == 0


async def test_a_decode_out_of_pages_gives_way_to_one_with_pages():
    async with serve(num_decodes=2) as served:
        first, second = (w.servicer for w in served.cluster.decodes)
        first.capacity = 0
        for _ in range(2):
            assert answered(await chat(served)) == EXPECTED
        assert first.num_refused >= 1 and not first.reserved and len(second.reserved) == 2
        assert retries(served, "decode") == 0  # not a failure: the normal path under load
