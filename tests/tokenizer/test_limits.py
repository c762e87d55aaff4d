"""The tokenizer cannot be exhausted by one request: over-long prompts are refused after
bounded work and memory, prompts at the limit behave as before, a slow job leaves the
other workers serving, and a full queue refuses instead of growing."""

from __future__ import annotations

import asyncio
import io
import os
import time
import zlib

import pytest
from PIL import Image

from services.common.envs import Envs
from services.common.errors import InvalidRequestError, OverloadedError
from services.engine.processing import TextProcessor
from services.tokenizer.__main__ import parse_config
from services.tokenizer.config import MAX_QUEUED_BYTES, Limits, default_num_workers
from services.tokenizer.workers import ChatJob, PromptJob, WorkerPool
from tests.conftest import TINY_MODEL_DIR
from tests.tokenizer.conftest import TEST_LIMITS, TIMEOUT_S, start_served, stop_served, user

BIG_TEXT_BYTES = 50 * 1024 * 1024
NO_HANG_S = 10.0  # generous: before the bound these took 68-155 s
WORKER_PEAK_GROWTH_BYTES = 512 * 1024 * 1024  # before the bound: 9.6 GB ("x") and 18.4 GB (words)
SLOW_IMAGE_SIDE = 6000  # decoding one such PNG takes about half a second


def distinct_words(num_bytes: int) -> str:
    """Random 8-letter words separated by spaces (about 2**32 of them: almost all distinct)."""
    letters = os.urandom(num_bytes * 4 // 9).hex(" ", 4)
    return letters.translate(str.maketrans("0123456789", "ghijklmnop"))


def worker_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def slow_png(seed: int) -> bytes:
    """A big PNG whose size only a full decode tells (a text chunk after its pixels), so the
    server cannot read it from the header and the worker decodes every pixel."""
    buf = io.BytesIO()
    Image.new("RGB", (SLOW_IMAGE_SIDE, SLOW_IMAGE_SIDE), (seed, 60, 90)).save(buf, format="PNG")
    data = buf.getvalue()
    iend = data.rindex(b"IEND") - 4  # the IEND chunk starts with its 4-byte length
    body = b"tEXt" + b"Comment\0after the pixels"
    chunk = (len(body) - 4).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")
    return data[:iend] + chunk + data[iend:]


@pytest.mark.slow
@pytest.mark.integration
async def test_huge_prompts_are_refused_after_bounded_work():
    served, server = await start_served(num_workers=1)
    try:
        (worker,) = served.pool._executor._processes.values()
        before = worker_memory(worker.pid)
        cases = {"x": "x" * BIG_TEXT_BYTES, "words": distinct_words(BIG_TEXT_BYTES)}
        for name, text in cases.items():
            for kind in ("prompt", "chat"):
                start = time.monotonic()
                with pytest.raises(InvalidRequestError) as info:
                    if kind == "prompt":
                        await served.client.tokenize_prompt(name, text, timeout_s=TIMEOUT_S)
                    else:
                        await served.client.tokenize_chat(name, [user(text)], timeout_s=TIMEOUT_S)
                assert time.monotonic() - start < NO_HANG_S, (name, kind)
                assert info.value.param == ("prompt" if kind == "prompt" else "messages")
                assert info.value.message.startswith("prompt has at least ")
                assert info.value.message.endswith(
                    f" tokens; the context limit is {TEST_LIMITS.max_model_len}"
                )
        after = worker_memory(worker.pid)
        assert after["VmHWM"] - before["VmHWM"] < WORKER_PEAK_GROWTH_BYTES, (before, after)
        assert after["VmRSS"] - before["VmRSS"] < WORKER_PEAK_GROWTH_BYTES // 4, (before, after)
        prompt = await served.client.tokenize_chat(
            "ok", [user("still there?")], timeout_s=TIMEOUT_S
        )
        assert len(prompt.token_ids) > 5
    finally:
        await stop_served(served, server)


@pytest.fixture(scope="module")
def text() -> TextProcessor:
    return TextProcessor.from_dir(TINY_MODEL_DIR)


# Longer in characters than in tokens, so the limit is checked by counting, not afterwards.
AT_LIMIT_TEXT = "hello world, how are you? " * 40


@pytest.mark.parametrize("kind", ["prompt", "chat"])
async def test_prompts_at_the_limit_behave_as_before(text, kind):
    if kind == "prompt":
        ids = text.encode(AT_LIMIT_TEXT)
    else:
        ids = text.encode_chat(
            [{"role": "user", "content": [{"type": "text", "text": AT_LIMIT_TEXT}]}]
        )
    assert len(AT_LIMIT_TEXT) > len(ids)
    for max_model_len in (len(ids) + 1, len(ids)):
        served, server = await start_served(0, Limits(max_model_len, TEST_LIMITS.max_image_bytes))
        try:
            if kind == "prompt":
                call = served.client.tokenize_prompt("r", AT_LIMIT_TEXT, timeout_s=TIMEOUT_S)
            else:
                call = served.client.tokenize_chat("r", [user(AT_LIMIT_TEXT)], timeout_s=TIMEOUT_S)
            if max_model_len > len(ids):
                assert list((await call).token_ids) == ids
            else:
                with pytest.raises(InvalidRequestError) as info:
                    await call
                assert (
                    info.value.message
                    == f"prompt has {len(ids)} tokens; the context limit is {len(ids)}"
                )
        finally:
            await stop_served(served, server)


SLOW_LIMITS = Limits(4096, max_image_bytes=20 * 1024 * 1024, max_image_pixels=SLOW_IMAGE_SIDE**2)


@pytest.fixture
async def two_workers():
    pool = WorkerPool(TINY_MODEL_DIR, SLOW_LIMITS, num_workers=2, max_queued_bytes=4 * 1024 * 1024)
    try:
        await pool.start()
        yield pool
    finally:
        pool.close()


def slow_job(seed: int) -> ChatJob:
    """Three distinct big images to decode: seconds of work for one worker."""
    return ChatJob(
        (user(slow_png(seed), "what are these?", slow_png(seed + 1), slow_png(seed + 2)),)
    )


async def finish_in_order(order: list[str], name: str, pool: WorkerPool, job) -> object:
    """Runs a job and appends its name to ``order`` when its result is back (completion order)."""
    result = await pool.run(job)
    order.append(name)
    return result


@pytest.mark.slow
@pytest.mark.integration
async def test_a_slow_job_leaves_the_other_worker_serving(two_workers):
    order: list[str] = []
    slow = asyncio.ensure_future(finish_in_order(order, "slow", two_workers, slow_job(0)))
    for i in range(5):
        job = PromptJob(f"quick {i}")
        prompt = await asyncio.wait_for(
            finish_in_order(order, f"quick {i}", two_workers, job), TIMEOUT_S
        )
        assert prompt.token_ids
    assert len((await asyncio.wait_for(slow, TIMEOUT_S)).spans) == 3
    assert order == [*(f"quick {i}" for i in range(5)), "slow"]
    assert two_workers.queued_bytes == 0


@pytest.mark.slow
@pytest.mark.integration
async def test_when_every_worker_is_busy_jobs_queue_within_a_byte_bound(two_workers):
    order: list[str] = []
    jobs = {
        "slow 0": slow_job(0),
        "slow 1": slow_job(10),
        "queued": PromptJob("waits for a worker"),
    }
    tasks = [
        asyncio.ensure_future(finish_in_order(order, name, two_workers, job))
        for name, job in jobs.items()
    ]
    await asyncio.sleep(0)  # all three submitted
    big = PromptJob("hi " * (2 * 1024 * 1024))  # over what is left of the 4 MiB bound
    with pytest.raises(OverloadedError, match="the tokenizer is busy"):
        await two_workers.run(big)
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    assert order[0] != "queued"  # it waited for a worker to finish a slow job
    assert two_workers.queued_bytes == 0
    with pytest.raises(
        InvalidRequestError, match="context limit"
    ):  # admitted once the queue drained
        await two_workers.run(big)
    assert two_workers.queued_bytes == 0


def test_default_num_workers_follows_the_cpus():
    assert default_num_workers() == max(1, min(len(os.sched_getaffinity(0)), 4))
    config, _ = parse_config([], Envs())
    assert (config.num_workers, config.max_queued_bytes) == (
        default_num_workers(),
        MAX_QUEUED_BYTES,
    )
    config, _ = parse_config(["--num-workers", "0", "--max-queued-bytes", "1000"], Envs())
    assert config.max_queued_bytes == 1000
    with pytest.raises(SystemExit):
        parse_config(["--max-queued-bytes", "0"], Envs())
