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
    [user(image_bytes(80 + 8 * i, 60, seed=i), f"picture {i}?")]
    if i % 2
    else [user(f"question {i}")]
    for i in range(8)
]


@pytest.mark.parametrize(
    "value",
    [
        ChatJob(
            (ChatMessage("user", (TextPart("hi"),)), user(b"\x89PNG", "x")),
            add_generation_prompt=False,
        ),
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
            *(
                client.tokenize_chat(f"r{i}", chat, timeout_s=TIMEOUT_S)
                for i, chat in enumerate(CHATS)
            )
        )

    assert await all_chats(served_processes.client) == await all_chats(served.client)


@pytest.mark.integration
async def test_dead_worker_fails_its_request_and_the_pool_recovers(served_processes):
    """A job the dead pool had taken fails as unavailable; one submitted to the pool once it
    is known broken goes to the new pool."""
    pool = served_processes.pool
    broken = pool._executor
    victim = next(iter(broken._processes.values()))
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(TIMEOUT_S)
    for _ in range(100):  # the pool notices the death asynchronously
        try:
            await served_processes.client.tokenize_prompt("r", "hi", timeout_s=TIMEOUT_S)
        except UnavailableError as exc:
            assert "worker process died" in exc.message
        if pool._executor is not broken:
            break
        await asyncio.sleep(0.05)
    assert pool._executor is not broken
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


def _late_metadata_png() -> bytes:
    """A PNG whose text chunk follows the pixel data: only a full decode can tell its size."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 20, 30)).save(buf, format="PNG")
    data = buf.getvalue()
    payload = b"Comment\x00late"
    chunk = struct.pack(">I", len(payload)) + b"tEXt" + payload
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + payload))
    iend = data.rindex(b"IEND") - 4
    return data[:iend] + chunk + data[iend:]


@pytest.mark.integration
async def test_image_bytes_stay_in_the_server_process_when_the_header_tells_the_size(
    served, served_processes, monkeypatch
):
    """Header-only formats cross to the worker as ``ImageHeader``s; the prompt has the bytes."""
    pool = served_processes.pool
    sent: list[bytes] = []
    submit = pool._submit
    monkeypatch.setattr(
        pool, "_submit", lambda ex, job, held=0: sent.append(job) or submit(ex, job, held)
    )
    jpeg, png = image_bytes(640, 480, seed=5, fmt="JPEG"), _late_metadata_png()
    prompt = await pool.run(ChatJob((user(jpeg, "which?", png, jpeg),)))
    assert list(prompt.images.values()) == [jpeg, png]  # distinct, first appearance first
    assert [s.grid_thw for s in prompt.spans][0] == [s.grid_thw for s in prompt.spans][2]
    (job,) = [msgspec.msgpack.decode(b, type=Job) for b in sent]
    kinds = [type(part).__name__ for part in job.messages[0].content]
    assert kinds == ["ImageHeader", "TextPart", "ImagePart", "ImageHeader"]
    assert len(sent[0]) < len(jpeg) // 4 + len(png) + 1024  # the JPEG's bytes did not travel
    thread_prompt = await served.pool.run(ChatJob((user(jpeg, "which?", png, jpeg),)))
    assert thread_prompt == prompt
    assert pool.queued_bytes == 0
