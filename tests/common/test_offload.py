"""``offload.sized``: work on a small input runs on the event loop, on a large one on the offload
thread while the loop keeps running, and either way returns or raises what the work did."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common import offload

LARGE = offload.INLINE_MAX_BYTES + 1


async def test_small_work_runs_on_the_loop_and_large_work_on_the_offload_thread():
    loop_thread = threading.current_thread()
    assert await offload.sized(offload.INLINE_MAX_BYTES, threading.current_thread) is loop_thread
    worker = await offload.sized(LARGE, threading.current_thread)
    assert worker is not loop_thread and worker.name.startswith("offload")


async def test_the_loop_runs_while_large_work_holds_its_thread():
    released = threading.Event()
    # on the loop, the wait would hold it for its whole timeout and return False
    work = asyncio.create_task(offload.sized(LARGE, released.wait, 30))
    await asyncio.sleep(0)  # the work starts
    released.set()  # the loop runs meanwhile
    assert await work is True


@pytest.mark.parametrize("num_bytes", [0, LARGE])
async def test_work_returns_its_value_or_raises_its_error(num_bytes):
    assert await offload.sized(num_bytes, b"-".join, [b"a", b"b"]) == b"a-b"
    assert await offload.sized(num_bytes, int, "12", base=16) == 18
    with pytest.raises(ValueError, match="invalid literal"):
        await offload.sized(num_bytes, int, "x")
