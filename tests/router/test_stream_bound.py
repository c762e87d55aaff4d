"""``StallBound.stream``: each wait for a stream's message is bounded like ``StallBound.call``'s,
with one timer per stream instead of one per message; and the decode client's per-stream
deadline (one timer per generate)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from services.common.clients.decode import DecodeClient
from services.common.errors import DeadlineExceededError, UnavailableError
from services.common.types import SamplingParams
from services.router.health_probe import HealthProbe
from services.router.metrics import RouterMetrics
from services.router.policy import RoundRobinPolicy
from services.router.progress import StallBound
from services.router.registry import WorkerRegistry
from services.router.workers import Hop, Worker, WorkerKind, WorkerState
from tests.router.conftest import BOUND_S
from tests.router.fake_decode import FakeDecode
from tests.router.fakes import Script, start_worker

STALL_S = 0.3


def bound_and_worker() -> tuple[StallBound, Worker]:
    worker = Worker(WorkerKind.DECODE, "d0", state=WorkerState.READY)
    registry = WorkerRegistry(
        [worker], RoundRobinPolicy(), RouterMetrics(CollectorRegistry()), HealthProbe(1.0)
    )
    return StallBound(registry, STALL_S), worker


class TimerCount:
    """Counts the timers scheduled on the running loop (``call_later`` goes through
    ``call_at``)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.count = 0
        self._call_at = self.loop.call_at

        def call_at(*args, **kwargs):
            self.count += 1
            return self._call_at(*args, **kwargs)

        self.loop.call_at = call_at  # type: ignore[method-assign]

    def restore(self) -> None:
        del self.loop.call_at


async def ticking(num: int, gap_s: float) -> AsyncIterator[int]:
    for i in range(num):
        await asyncio.sleep(gap_s)
        yield i


async def test_a_moving_stream_passes_with_a_few_timers_over_many_messages():
    bound, worker = bound_and_worker()
    timers = TimerCount()
    messages = ticking(200, 0.0)  # sleep(0) schedules no timer
    stream = bound.stream(Hop.GENERATE, worker, "r")
    try:
        got = [await stream.next(messages) for _ in range(200)]
        with pytest.raises(StopAsyncIteration):
            await stream.next(messages)
    finally:
        stream.close()
        timers.restore()
    assert got == list(range(200))
    assert timers.count <= 2, timers.count  # one per stream (and one re-arm), none per message
    assert worker.num_stalls == 0


async def test_messages_spread_over_several_stall_limits_do_not_stall():
    bound, worker = bound_and_worker()
    stream = bound.stream(Hop.GENERATE, worker, "r")
    messages = ticking(12, STALL_S / 4)  # 3 limits in all, every gap well inside one
    try:
        got = [await stream.next(messages) for _ in range(12)]
    finally:
        stream.close()
    assert got == list(range(12)) and worker.num_stalls == 0


async def test_a_silent_stream_is_unavailable_naming_the_hop_and_counts_a_stall():
    bound, worker = bound_and_worker()

    async def silent_after_two() -> AsyncIterator[int]:
        yield 0
        yield 1
        await asyncio.sleep(BOUND_S)
        yield 2

    messages = silent_after_two()
    stream = bound.stream(Hop.GENERATE, worker, "req-7")
    try:
        assert [await stream.next(messages), await stream.next(messages)] == [0, 1]
        with pytest.raises(UnavailableError) as info:
            await asyncio.wait_for(stream.next(messages), BOUND_S)
    finally:
        stream.close()
        await messages.aclose()
    assert "request req-7: the decode worker sent nothing for 0.3 s" in info.value.message
    assert worker.num_stalls == 1


async def test_a_cancellation_from_outside_passes_through_and_is_not_a_stall():
    bound, worker = bound_and_worker()

    async def never() -> AsyncIterator[int]:
        await asyncio.sleep(BOUND_S)
        yield 0

    messages = never()
    stream = bound.stream(Hop.GENERATE, worker, "r")
    with pytest.raises(TimeoutError):  # the request's deadline, not the stall bound
        async with asyncio.timeout(STALL_S / 3):
            await stream.next(messages)
    stream.close()
    await messages.aclose()
    assert worker.num_stalls == 0


async def deadline_run(num_messages: int) -> tuple[int, int]:
    """A generate of 0.5 s on a fake decode that sends ``num_messages`` one-token messages,
    then nothing: (tokens received, timers scheduled meanwhile), once decode saw the request
    cancelled (the stream's abort message). The fake decode shares the loop; its own timers
    do not depend on ``num_messages``."""
    decode = FakeDecode(Script(output_ids=list(range(100, 200)), chunk_size=1))
    decode.hang_after = num_messages
    worker = await start_worker(decode)
    client = DecodeClient(worker.address)
    try:
        params = SamplingParams(max_new_tokens=90)
        await client.reserve("r1", [1, 2, 3], 0, params, time.time() + 10)
        got: list[int] = []
        timers = TimerCount()
        try:
            with pytest.raises(DeadlineExceededError, match="did not finish within 0.5 s"):
                async with asyncio.timeout(BOUND_S):
                    proof = decode.proofs["r1"]
                    async for chunk in client.generate("r1", 7, 0.5, kv_written_proof=proof):
                        got.extend(chunk.token_ids)
        finally:
            timers.restore()
        async with asyncio.timeout(BOUND_S):
            while "r1" not in decode.cancelled:
                await asyncio.sleep(0.02)
        return len(got), timers.count
    finally:
        await client.close()
        await worker.server.stop(None)


async def test_decode_generate_raises_at_its_deadline_after_its_tokens_and_aborts():
    """The tokens sent before the deadline arrive; then DeadlineExceededError, and the request
    is aborted on decode; the deadline is one timer, not one per message."""
    (few, few_timers), (many, many_timers) = await deadline_run(3), await deadline_run(40)
    assert few == 3 and many == 40
    assert few_timers == many_timers, (few_timers, many_timers)
