"""The decode leader's drain (SIGTERM): no new Reserve, the requests it holds (reserved and
generating) go on to their end, and the drain returns once none is left or its budget is
spent."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import UnavailableError
from services.common.types import FinishReason, SamplingParams
from services.decode.drain import Drain
from services.decode.routes import Routes
from tests.decode.conftest import WAIT_S, MakeDecode, prompt_of

LONG = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)


async def test_a_drain_refuses_reserves_and_lets_held_requests_finish(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode()
    running_ref, first = await harness.reserve_and_prefill("running", prompt_of(5, 1), LONG)
    chunks = harness.generate(running_ref, first)
    head = await anext(chunks)  # generating when the drain starts
    reserved_ref = await harness.reserve("reserved", prompt_of(6, 2), LONG)
    drain = asyncio.create_task(harness.leader.drain(WAIT_S))
    await asyncio.sleep(0)  # the drain's first step: it refuses from here on
    with pytest.raises(UnavailableError, match="shutting down and takes no new requests"):
        await harness.reserve("late", prompt_of(5, 3), LONG)
    assert not drain.done()
    rest = [chunk async for chunk in chunks]
    assert rest[-1].finish_reason is FinishReason.LENGTH
    assert 1 + sum(len(c.token_ids) for c in [head, *rest]) == LONG.max_new_tokens
    assert not drain.done()  # the reserved request is still held
    first = harness.prefill.prefill("reserved", prompt_of(6, 2), LONG, reserved_ref)
    rest = [chunk async for chunk in harness.generate(reserved_ref, first)]
    assert rest[-1].finish_reason is FinishReason.LENGTH
    assert 1 + sum(len(c.token_ids) for c in rest) == LONG.max_new_tokens
    async with asyncio.timeout(WAIT_S):
        await drain
    await harness.wait_all_pages_free()


async def test_a_drain_returns_when_its_budget_is_spent(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    await harness.reserve("held", prompt_of(5, 1), LONG)  # its generate never comes
    async with asyncio.timeout(WAIT_S):
        await harness.leader.drain(0.05)
    assert harness.stats().num_reserved_requests == 1  # left for the stop to fail
    assert await harness.client.abort("held", "test over", is_kv_written=True)
    await harness.wait_all_pages_free()


async def test_a_drain_with_nothing_held_returns_at_once(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    async with asyncio.timeout(WAIT_S):
        await harness.leader.drain(3600.0)


async def test_a_drain_returns_once_the_last_live_request_leaves() -> None:
    drain, routes = Drain(), Routes()
    drain.check_admits()  # not draining yet: admits
    route = routes.add("held", 0)
    task = asyncio.create_task(drain.run(routes, 3600.0))
    await asyncio.sleep(0)
    with pytest.raises(UnavailableError, match="shutting down and takes no new requests"):
        drain.check_admits()
    assert not task.done()
    routes.drop("held", route)
    async with asyncio.timeout(WAIT_S):
        await task


async def test_the_stop_after_a_spent_drain_names_its_budget() -> None:
    drain, routes = Drain(), Routes()
    assert drain.stop_reason() == "decode is shutting down"
    routes.add("held", 0)
    async with asyncio.timeout(WAIT_S):
        await drain.run(routes, 0.05)
    assert "held" in routes  # left for the stop to fail
    assert drain.stop_reason() == "decode is shutting down (its drain budget of 0.05 s ran out)"
