"""The per-hop progress bound over fake workers that answer nothing (frozen, port still open).

Each hop that stalls ends the request once the bound has passed (long before the request
deadline would) with UNAVAILABLE naming the hop, cancels the call on the worker, aborts the
request on decode with the right ``is_kv_written``, and counts the stall; the request
deadline still bounds the whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import httpx
import pytest

from services.common.client import create_channel
from services.common.pb.stageserve.v1 import router_pb2, router_pb2_grpc
from services.router.config import FlowConfig, LimitsConfig
from tests.router.conftest import BOUND_S, MODEL_NAME, wait_until
from tests.router.fakes import Script
from tests.router.served import Served
from tests.router.served import serve as serve_flow

STALL_S = 1.0
# Generous on a loaded machine, yet far inside the request deadline (BOUND_S): the error
# message and the stall counter show which bound ended the request.
ENDED_WITHIN_S = STALL_S + 10.0
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}


def stalls(served: Served, hop: str, address: str) -> float:
    return served.metric("worker_stalls_total", hop=hop, address=address)


def only_request_id(served: Served) -> str:
    [request_id] = served.cluster.decode.reserved
    return request_id


def serve(
    script: Script | None = None, stall_s: float = STALL_S, **overrides
) -> contextlib.AbstractAsyncContextManager[Served]:
    return serve_flow(
        FlowConfig(stall_timeout_s=stall_s), script or Script(chunk_size=1), **overrides
    )


async def timed_post(http: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await http.post("/v1/chat/completions", json=body)
    return response, time.monotonic() - started


def assert_stall_503(response: httpx.Response, elapsed_s: float, silence: str) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "service_unavailable"
    assert f"{silence} for 1 s (--stall-timeout-s)" in error["message"], error
    assert STALL_S <= elapsed_s < ENDED_WITHIN_S, elapsed_s


async def test_a_stalled_tokenizer_ends_the_request():
    async with serve() as served:
        tokenizer = served.cluster.tokenizer
        tokenizer.servicer.hang = True
        response, elapsed_s = await timed_post(served.http, CHAT)
        assert_stall_503(response, elapsed_s, "the tokenizer worker answered nothing")
        [request] = tokenizer.servicer.requests
        await wait_until(
            lambda: tokenizer.servicer.cancelled == [request.request_id]
        )  # cancelled there
        assert stalls(served, "tokenize", tokenizer.address) == 1
        assert not served.cluster.decode.reserved
        workers = (await served.http.get("/health")).json()["workers"]
        assert [w["stalls"] for w in workers if w["kind"] == "tokenizer"] == [1]


async def test_a_stalled_reserve_ends_the_request_and_aborts_it_on_decode():
    async with serve() as served:
        decode = served.cluster.decode
        decode.hang_reserve = True
        response, elapsed_s = await timed_post(served.http, CHAT)
        assert_stall_503(response, elapsed_s, "the decode worker answered no Reserve")
        await wait_until(lambda: len(decode.cancelled) == 1)
        await wait_until(lambda: served.cluster.is_kv_written() == {decode.cancelled[0]: False})
        assert stalls(served, "reserve", served.cluster.decodes[0].address) == 1
        assert not served.cluster.prefill.requests


async def test_a_stalled_prefill_is_cancelled_there_and_the_pages_are_quarantined():
    async with serve() as served:
        prefill = served.cluster.prefill
        prefill.hang = True
        response, elapsed_s = await timed_post(served.http, CHAT)
        assert_stall_503(response, elapsed_s, "the prefill worker sent no first token")
        request_id = only_request_id(served)
        await wait_until(
            lambda: prefill.cancelled == [request_id]
        )  # the call is cancelled at prefill
        await wait_until(lambda: served.cluster.is_kv_written() == {request_id: False})
        assert stalls(served, "prefill", served.cluster.prefills[0].address) == 1


async def test_a_prefill_queued_past_the_bound_while_its_worker_completes_others_is_not_a_stall():
    """A busy prefill (a request behind others in its queue) is not a frozen one."""
    async with serve() as served:
        prefill = served.cluster.prefill
        prefill.first_delay_s = 3 * STALL_S
        held = asyncio.create_task(timed_post(served.http, {**CHAT, "max_tokens": 2}))
        await wait_until(lambda: len(prefill.requests) == 1 or held.done())
        assert not held.done(), held.result()[0].text
        others = []
        while not held.done():  # another request through the same worker every 0.3 s
            others.append(
                await served.http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            )
            await asyncio.sleep(0.3)
        response, elapsed_s = await held
        assert response.status_code == 200, response.text
        assert elapsed_s >= 3 * STALL_S
        assert len(others) >= 5 and all(r.status_code == 200 for r in others)
        assert stalls(served, "prefill", served.cluster.prefills[0].address) == 0


@pytest.mark.parametrize("num_messages", [0, 3])
async def test_a_stalled_decode_stream_ends_the_request_and_aborts_it(num_messages):
    async with serve() as served:
        decode = served.cluster.decode
        decode.hang_after = num_messages
        response, elapsed_s = await timed_post(served.http, CHAT)
        assert_stall_503(response, elapsed_s, "the decode worker sent nothing")
        request_id = only_request_id(served)
        await wait_until(lambda: decode.cancelled == [request_id])
        # prefill had written: decode frees the pages at once
        await wait_until(lambda: served.cluster.is_kv_written() == {request_id: True})
        assert stalls(served, "generate", served.cluster.decodes[0].address) == 1


async def test_a_request_waiting_on_decode_past_the_bound_is_not_a_stall():
    """Decode lists a request that waits for a place in its batch: alive, not frozen."""
    async with serve() as served:
        served.cluster.decode.waiting_s = 3 * STALL_S
        response, elapsed_s = await timed_post(served.http, {**CHAT, "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "Hell"
        assert elapsed_s >= 3 * STALL_S
        assert stalls(served, "generate", served.cluster.decodes[0].address) == 0


async def test_a_stall_after_the_first_byte_is_an_sse_error_event():
    async with serve() as served:
        served.cluster.decode.hang_after = 3
        response, elapsed_s = await timed_post(served.http, {**CHAT, "stream": True})
        assert response.status_code == 200 and STALL_S <= elapsed_s < ENDED_WITHIN_S
        events = [line[len("data: ") :] for line in response.text.split("\n\n") if line.strip()]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chunks if "choices" in c
        )
        assert text == "Hell"  # prefill's token and three decode messages
        error = chunks[-1]["error"]
        assert error["type"] == "service_unavailable"
        assert "the decode worker sent nothing for 1 s" in error["message"]
        assert stalls(served, "generate", served.cluster.decodes[0].address) == 1
        request_id = only_request_id(served)
        await wait_until(lambda: served.cluster.is_kv_written() == {request_id: True})


async def test_a_stall_over_grpc_is_unavailable():
    async with serve() as served:
        served.cluster.decode.hang_after = 1
        channel = create_channel(f"127.0.0.1:{served.app.grpc_port}")
        try:
            stub = router_pb2_grpc.RouterStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(
                    router_pb2.GenerateRequest(prompt="hi"), timeout=BOUND_S
                ):
                    pass
        finally:
            await channel.close()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the decode worker sent nothing for 1 s" in info.value.details()


async def test_a_slow_but_moving_stream_is_bounded_by_the_request_deadline():
    script = Script(chunk_size=1, chunk_delay_s=0.2)  # each gap well inside the stall bound
    limits = LimitsConfig(request_timeout_s=1.5, max_image_bytes=64 * 1024)
    # a stall bound far past the deadline: a loaded machine's one long gap (a 1 s bound was
    # crossed once in CI) cannot end the request before its deadline does
    async with serve(script, stall_s=4 * STALL_S, limits=limits) as served:
        response = await served.http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 504, response.text
        assert "deadline" in response.json()["error"]["message"]
        assert stalls(served, "generate", served.cluster.decodes[0].address) == 0
