"""The decode service's KV pages over real gRPC: capacity, abort, cancellation,
quarantine of reservations that fail before KV-ready, expiry, and no page lost."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import (
    AbortedError,
    CapacityError,
    DeadlineExceededError,
    NotFoundError,
)
from services.common.types import SamplingParams
from tests.decode.conftest import MakeDecode, prompt_of


async def test_capacity_is_resource_exhausted_until_pages_come_back(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode(num_pages=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=28)  # 4 + 28 positions = 8 pages
    await harness.reserve("a", prompt_of(4, 1), params)
    await harness.reserve("b", prompt_of(4, 2), params)
    with pytest.raises(CapacityError):
        await harness.reserve("c", prompt_of(4, 3), params)
    assert (await harness.client.stats()).num_free_pages == 0
    assert await harness.client.abort("a", "test")  # never written: its 8 pages go to quarantine
    with pytest.raises(CapacityError, match="8 in quarantine"):
        await harness.reserve("c", prompt_of(4, 3), params)
    await harness.pass_quarantine()
    await harness.reserve("c", prompt_of(4, 3), params)
    for request_id in ("b", "c"):
        assert await harness.client.abort(request_id, "test")


async def test_abort_mid_stream_ends_it_cancelled_and_frees_pages(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)
    prompt = prompt_of(8, 1)
    kv_ref, first = await harness.reserve_and_prefill("r", prompt, params)
    stream = harness.generate(kv_ref, first)
    assert (await anext(stream)).finish_reason is None
    assert await harness.client.abort("r", "client went away")
    with pytest.raises(AbortedError, match="client went away"):
        async for _ in stream:
            pass
    assert not await harness.client.abort("r", "again")  # idempotent
    await harness.wait_all_pages_free()
    stats = await harness.client.stats()
    assert stats.num_running_requests == stats.num_reserved_requests == 0


async def test_cancelled_stream_aborts_the_request(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)
    prompt = prompt_of(8, 1)
    kv_ref, first = await harness.reserve_and_prefill("r", prompt, params)
    async for _ in harness.generate(kv_ref, first):
        break  # the router's client disconnected
    await harness.wait_for(lambda: harness.stats().num_running_requests == 0)
    await harness.wait_all_pages_free()
    assert not await harness.client.abort("r", "late")


async def page_counts(harness) -> tuple[int, int, int]:
    """(free, used, quarantined) from Stats, checking that they add up to the pool, overall and per rank."""
    stats = await harness.client.stats()
    for counts in (stats, *stats.ranks):
        assert (
            counts.num_free_pages + counts.num_used_pages + counts.num_quarantined_pages
            == counts.num_total_pages
        )
    assert stats.num_quarantined_pages == sum(r.num_quarantined_pages for r in stats.ranks)
    return stats.num_free_pages, stats.num_used_pages, stats.num_quarantined_pages


async def test_abort_reserved_request_quarantines_its_pages(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    start = harness.num_start_free_pages
    kv_ref = await harness.reserve(
        "r", prompt_of(8, 1), SamplingParams(max_new_tokens=12)
    )  # 20 positions: 5 pages
    assert (await harness.client.stats()).num_reserved_requests == 1
    assert await page_counts(harness) == (start - 5, 5, 0)
    assert await harness.client.abort("r", "prefill failed")  # prefill may still be writing its KV
    assert await page_counts(harness) == (start - 5, 0, 5)
    assert (await harness.client.stats()).num_reserved_requests == 0
    with pytest.raises(NotFoundError):
        async for _ in harness.generate(kv_ref, 7):
            pass
    await harness.reserve(
        "r", prompt_of(8, 1), SamplingParams(max_new_tokens=12)
    )  # the id is free again
    assert await page_counts(harness) == (start - 10, 5, 5)
    assert await harness.client.abort("r", "again")
    await harness.pass_quarantine()
    assert await page_counts(harness) == (start, 0, 0)


async def test_abort_with_kv_written_frees_a_reservation_at_once(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompt = prompt_of(8, 1)
    kv_ref = await harness.reserve("r", prompt, params)
    harness.prefill.prefill(
        "r", prompt, params, kv_ref
    )  # the KV landed; the first token ends it (router side)
    assert await harness.client.abort("r", "the first token finished it", is_kv_written=True)
    assert await page_counts(harness) == (harness.num_start_free_pages, 0, 0)
    assert not await harness.client.abort("r", "again", is_kv_written=True)


async def test_abort_of_a_running_request_frees_at_once(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)
    prompt = prompt_of(8, 2)
    kv_ref, first = await harness.reserve_and_prefill("r", prompt, params)
    stream = harness.generate(kv_ref, first)
    assert (await anext(stream)).finish_reason is None
    assert await harness.client.abort(
        "r", "a stop string matched"
    )  # running: no is_kv_written needed
    with pytest.raises(AbortedError):
        async for _ in stream:
            pass
    await (
        harness.wait_all_pages_free()
    )  # after the step in flight; the quarantine clock never moved
    assert await page_counts(harness) == (harness.num_start_free_pages, 0, 0)


async def test_reservation_expires_at_its_deadline(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    start = harness.num_start_free_pages
    kv_ref = await harness.reserve(
        "r", prompt_of(8, 1), SamplingParams(max_new_tokens=12), deadline_in_s=0.2
    )
    await harness.wait_for(lambda: harness.stats().num_reserved_requests == 0)
    assert await page_counts(harness) == (
        start - 5,
        0,
        5,
    )  # a late write may still land: quarantined
    with pytest.raises(NotFoundError, match="unknown, expired or aborted"):
        async for _ in harness.generate(kv_ref, 7):
            pass
    await harness.pass_quarantine()
    assert await page_counts(harness) == (start, 0, 0)


async def test_free_pages_return_after_a_mixed_workload(make_decode: MakeDecode) -> None:
    harness = await make_decode(num_pages=128)
    start = await harness.client.stats()
    assert start.num_free_pages == start.num_total_pages == 128 and start.page_size == 4

    async def finished(i: int) -> None:
        await harness.run(
            f"ok-{i}", prompt_of(3 + i, i), SamplingParams(temperature=0.0, max_new_tokens=10)
        )

    async def aborted(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)  # 17 pages
        kv_ref, first = await harness.reserve_and_prefill(f"abort-{i}", prompt_of(6, i), params)
        async for _ in harness.generate(kv_ref, first):
            await harness.client.abort(f"abort-{i}", "test")

    async def never_generated(i: int) -> None:
        try:  # the short deadline may also pass during the call; pages are freed either way
            await harness.reserve(
                f"reserved-{i}", prompt_of(6, i), SamplingParams(), deadline_in_s=0.2
            )
        except DeadlineExceededError:
            pass

    async def rejected(i: int) -> None:
        try:
            await harness.reserve(
                f"big-{i}", prompt_of(20, i), SamplingParams(max_new_tokens=200)
            )  # 55 pages
        except CapacityError:
            pass
        else:
            await harness.client.abort(f"big-{i}", "test")

    jobs = [f(i) for i in range(3) for f in (finished, aborted, never_generated, rejected)]
    outcomes = await asyncio.gather(*jobs, return_exceptions=True)
    assert all(o is None or isinstance(o, AbortedError | CapacityError) for o in outcomes), outcomes
    await harness.wait_for(lambda: harness.stats().num_reserved_requests == 0)
    await page_counts(harness)
    await harness.pass_quarantine()  # expired and aborted reservations
    end = await harness.client.stats()
    assert end.num_free_pages == start.num_free_pages
    assert end.num_running_requests == end.num_reserved_requests == end.num_used_pages == 0
    assert end.num_quarantined_pages == 0
    assert len(end.ranks) == 1 and end.ranks[0].num_free_pages == end.num_free_pages
