"""The worker pool (processes and thread), the job wire format, and the tokenize span."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.errors import UnavailableError
from services.common.types import ChatMessage, TextPart, TokenizedPrompt
from services.tokenizer.workers import ChatJob, Job, JobDone, JobRejected, JobResult, PromptJob
from tests.conftest import image_bytes, sdk_provider
from tests.tokenizer.conftest import TIMEOUT_S, start_served, stop_served, user

CHATS = [
    [user(image_bytes(80 + 8 * i, 60, seed=i), f"picture {i}?")] if i % 2 else [user(f"question {i}")]
    for i in range(8)
]


@pytest.mark.parametrize(
    "value",
    [
        ChatJob((ChatMessage("user", (TextPart("hi"),)), user(b"\x89PNG", "x")), add_generation_prompt=False),
        PromptJob("once"),
    ],
)
def test_job_round_trip(value):
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=Job) == value


def test_result_round_trip():
    done = JobDone(TokenizedPrompt((1, 5, 5), images={"ab": b"\x00\x01"}, mrope_position_delta=-3))
    for value in (done, JobRejected("bad role", "messages[0].role"), JobRejected("no param")):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=JobResult) == value


@pytest.fixture
async def served_processes():
    served, server = await start_served(num_workers=2)
    try:
        yield served
    finally:
        await stop_served(served, server)


@pytest.mark.integration
async def test_worker_processes_match_thread(served, served_processes):
    async def all_chats(client):
        return await asyncio.gather(
            *(client.tokenize_chat(f"r{i}", chat, timeout_s=TIMEOUT_S) for i, chat in enumerate(CHATS))
        )

    assert await all_chats(served_processes.client) == await all_chats(served.client)


@pytest.mark.integration
async def test_dead_worker_fails_its_request_and_the_pool_recovers(served_processes):
    pool = served_processes.pool
    victim = next(iter(pool._executor._processes.values()))
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(TIMEOUT_S)
    failures = 0
    for _ in range(100):  # the pool notices the death asynchronously; some request then fails
        try:
            await served_processes.client.tokenize_prompt("r", "hi", timeout_s=TIMEOUT_S)
        except UnavailableError as exc:
            assert "worker process died" in exc.message
            failures += 1
            break
        await asyncio.sleep(0.05)
    assert failures == 1
    prompt = await served_processes.client.tokenize_chat("r", CHATS[1], timeout_s=TIMEOUT_S)
    assert len(prompt.spans) == 1


async def test_tokenize_span_continues_the_callers_trace(served):
    exporter = InMemorySpanExporter()
    sdk_provider().add_span_processor(SimpleSpanProcessor(exporter))
    with trace.get_tracer("test").start_as_current_span("router.request") as parent:
        await served.client.tokenize_chat("traced", [user("hi")], timeout_s=TIMEOUT_S)
    exporter.shutdown()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tokenizer.tokenize"]
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
    assert span.attributes["request_id"] == "traced"
    assert span.attributes["num_prompt_tokens"] > 0
