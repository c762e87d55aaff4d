"""The official ``openai`` client against the router's uvicorn server (fake workers behind it):
streaming, errors, deadlines, client disconnects and a decode that dies mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import openai
import pytest

from services.router.app import RouterApp
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    Cluster,
    router_config,
    serve_http,
    stop_router,
    wait_until,
)
from tests.router.fakes import EOS_ID, char_ids

EXPECTED = "Hello there, world!"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
async def served(cluster: Cluster) -> AsyncIterator[tuple[RouterApp, str]]:
    app, url = await serve_http(router_config(cluster))
    yield app, url
    await stop_router(app)


@pytest.fixture
async def client(served) -> AsyncIterator[openai.AsyncOpenAI]:
    _, url = served
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
    )
    yield client
    await client.close()


async def test_chat_stream_and_not(client, cluster):
    reply = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=50)
    assert reply.choices[0].message.content == EXPECTED
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(cluster.script.output_ids)
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == EXPECTED
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["stop"]


async def test_completions_and_models(client):
    assert [m.id async for m in client.models.list()] == [MODEL_NAME]
    reply = await client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=4)
    assert reply.choices[0].text == EXPECTED[:4] and reply.choices[0].finish_reason == "length"
    stream = await client.completions.create(
        model=MODEL_NAME, prompt="Once", max_tokens=4, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream]) == EXPECTED[:4]


async def test_stop_string_across_tokens_while_streaming(client, cluster):
    cluster.script.chunk_size = 1
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stream=True, stop=["re, w"]
    )
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(deltas) == "Hello the"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=9)
    assert info.value.status_code == 400 and info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="other", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=-1)
    reply = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert reply.choices[0].message.content == EXPECTED


async def test_no_ready_worker_is_a_503_at_once(client, served, cluster):
    app, url = served
    cluster.decodes[0].health.set_serving(False)
    await app.registry.poll_once()
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert info.value.status_code == 503
    assert "decode" in info.value.message
    async with httpx.AsyncClient(timeout=BOUND_S) as http:
        health = await http.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["missing"] == ["decode"]
    cluster.decodes[0].health.set_serving(True)  # readmitted by the background poll
    await wait_until(lambda: app.registry.is_ready)
    assert (
        (await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES))
        .choices[0]
        .message.content
    )


async def test_deadline_is_a_504_and_decode_is_aborted(cluster):
    cluster.script.chunk_delay_s = 60
    app, url = await serve_http(
        replace(
            router_config(cluster),
            limits=replace(router_config(cluster).limits, request_timeout_s=0.5),
        )
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
            response = await http.post(
                "/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES}
            )
            assert response.status_code == 504
            assert response.json()["error"]["type"] == "timeout"
            await wait_until(lambda: len(cluster.aborted()) == 1)
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": MESSAGES, "stream": True},
            ) as stream:
                assert stream.status_code == 200  # the first token came before the deadline
                events = [line async for line in stream.aiter_lines() if line]
            assert '"type":"timeout"' in events[-2] and events[-1] == "data: [DONE]"
            await wait_until(lambda: len(cluster.aborted()) == 2)
            assert list(cluster.is_kv_written().values()) == [
                True,
                True,
            ]  # both timed out after prefill
    finally:
        await stop_router(app)


async def test_client_disconnect_while_streaming_aborts_decode(served, cluster):
    _, url = served
    cluster.script.output_ids = [*char_ids("x" * 200), EOS_ID]
    cluster.script.chunk_size, cluster.script.chunk_delay_s = 1, 0.02
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": MESSAGES, "stream": True},
        ) as stream:
            lines = stream.aiter_lines()
            for _ in range(3):
                await anext(lines)
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))
    assert cluster.is_kv_written() == dict.fromkeys(cluster.decode.reserved, True)


async def test_client_disconnect_during_prefill_aborts_decode_with_kv_not_written(served, cluster):
    _, url = served
    cluster.script.prefill_delay_s = 60
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
        request = asyncio.create_task(
            http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES})
        )
        await wait_until(lambda: bool(cluster.prefill.requests))
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))
    assert cluster.is_kv_written() == dict.fromkeys(
        cluster.decode.reserved, False
    )  # prefill may still write


async def test_client_disconnect_while_waiting_aborts_decode(served, cluster):
    _, url = served
    cluster.script.chunk_delay_s = 60
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
        request = asyncio.create_task(
            http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES})
        )
        await asyncio.wait_for(cluster.decode.generate_started.wait(), BOUND_S)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))


async def test_decode_dying_mid_stream_ends_the_stream_and_is_ejected(client, served, cluster):
    app, _ = served
    cluster.script.chunk_size, cluster.script.decode_fail_after = 1, 3
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True)
    received = []
    with pytest.raises(openai.APIError):
        async for chunk in stream:
            received.append(chunk)
    assert len(received) >= 3
    await wait_until(lambda: not app.registry.is_ready)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert info.value.status_code == 503
