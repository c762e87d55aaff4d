"""The tokenizer cannot be exhausted by one request: over-long prompts are refused after
bounded work and memory, and prompts at the limit behave as before."""

from __future__ import annotations

import os
import time

import pytest

from services.common.errors import InvalidRequestError
from services.engine.processing import TextProcessor
from services.tokenizer.config import Limits
from tests.conftest import TINY_MODEL_DIR
from tests.tokenizer.conftest import TEST_LIMITS, TIMEOUT_S, start_served, stop_served, user

BIG_TEXT_BYTES = 50 * 1024 * 1024
NO_HANG_S = 10.0  # generous: before the bound these took 68-155 s
WORKER_PEAK_GROWTH_BYTES = 512 * 1024 * 1024  # before the bound: 9.6 GB ("x") and 18.4 GB (words)


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
                assert info.value.message.endswith(f" tokens; the context limit is {TEST_LIMITS.max_model_len}")
        after = worker_memory(worker.pid)
        assert after["VmHWM"] - before["VmHWM"] < WORKER_PEAK_GROWTH_BYTES, (before, after)
        assert after["VmRSS"] - before["VmRSS"] < WORKER_PEAK_GROWTH_BYTES // 4, (before, after)
        prompt = await served.client.tokenize_chat("ok", [user("still there?")], timeout_s=TIMEOUT_S)
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
        ids = text.encode_chat([{"role": "user", "content": [{"type": "text", "text": AT_LIMIT_TEXT}]}])
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
                assert info.value.message == f"prompt has {len(ids)} tokens; the context limit is {len(ids)}"
        finally:
            await stop_served(served, server)
