"""The decode leader over D ranks (on threads): placement, a rank dying under a Reserve, Stats
per rank, and the Stream call's own rules (a malformed message, a request's deadline, a
cancelled call)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common import signing
from services.common.client import create_channel
from services.common.errors import UnavailableError
from services.common.pb.stageserve.v1 import decode_pb2, decode_pb2_grpc
from services.common.types import SamplingParams
from services.decode.messages import ReserveCommand
from tests.decode.conftest import KEY, WAIT_S, MakeDecode, offline_tokens, prompt_of

LONG = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)


async def test_reserves_spread_over_the_ranks_and_every_rank_matches_the_offline_engine(
    make_decode: MakeDecode, offline
) -> None:
    harness = await make_decode(num_ranks=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    kv_refs = await asyncio.gather(
        *(harness.reserve(f"r{i}", prompt_of(5, i), params) for i in range(20))
    )
    by_rank = [sum(k.dp_rank == r for k in kv_refs) for r in (0, 1)]
    assert max(by_rank) <= 12 and sum(by_rank) == 20
    stats = await harness.client.stats()
    assert [
        r.num_reserved_requests for r in stats.ranks
    ] == by_rank and stats.num_reserved_requests == 20
    for kv_ref in kv_refs[2:]:
        assert await harness.client.abort(kv_ref.request_id, "test", is_kv_written=True)
    for kv_ref in kv_refs[:2]:  # one on each rank: generate there
        first = harness.prefill.prefill(
            kv_ref.request_id, prompt_of(5, int(kv_ref.request_id[1:])), params, kv_ref
        )
        tokens = [first] + [t async for c in harness.generate(kv_ref, first) for t in c.token_ids]
        assert (
            tokens == offline_tokens(offline, prompt_of(5, int(kv_ref.request_id[1:])), params)[0]
        )


async def test_a_rank_dying_under_a_reserve_gives_way_to_another_rank_once(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode(num_ranks=2)
    first, second = harness.ranks

    def die_on_reserve(payload) -> None:
        if any(isinstance(c, ReserveCommand) for c in payload.commands):
            first.before_step = None
            first.crash()

    first.before_step = die_on_reserve
    kv_ref = await harness.reserve("r", prompt_of(5, 1), SamplingParams())  # placed on rank 0 first
    assert kv_ref.dp_rank == 1 and len(first.commands) > 0
    stats = await harness.client.stats()
    assert [r.is_serving for r in stats.ranks] == [False, True]
    assert (stats.ranks[0].num_total_pages, stats.num_total_pages) == (
        0,
        stats.ranks[1].num_total_pages,
    )
    assert await harness.client.abort("r", "test", is_kv_written=True)
    second.before_step = lambda payload: second.crash() if payload.commands else None
    with pytest.raises(UnavailableError):
        await harness.reserve("r2", prompt_of(5, 2), SamplingParams())
    assert not harness.leader.is_ready
    second.before_step = None
    await first.restart()
    await second.restart()
    await harness.wait_for(
        lambda: (
            harness.leader.is_ready
            and len(harness.leader.rank_loads()) == 2
            and all(harness.leader.rank_loads())
        )
    )


async def open_stream(harness):
    channel = create_channel(harness.client.address)
    outbox: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (message := await outbox.get()) is not None:
            yield message

    return channel, outbox, decode_pb2_grpc.DecodeStub(channel).Stream(messages(), timeout=WAIT_S)


def generate_message(
    kv_ref, first: int, deadline_unix_ms: int = 0
) -> decode_pb2.DecodeStreamRequest:
    proof = signing.kv_written_proof(KEY, kv_ref.request_id, kv_ref.nonce)
    start = decode_pb2.DecodeGenerateRequest(
        request_id=kv_ref.request_id,
        first_token_id=first,
        kv_written_proof=proof,
        deadline_unix_ms=deadline_unix_ms,
    )
    return decode_pb2.DecodeStreamRequest(generate=start)


async def test_a_malformed_stream_message_ends_that_stream_only(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    kv_ref, first = await harness.reserve_and_prefill("victim", prompt_of(5, 1), LONG)
    survivor = asyncio.ensure_future(
        harness.run("survivor", prompt_of(6, 2), SamplingParams(temperature=0.0, max_new_tokens=30))
    )
    channel, outbox, call = await open_stream(harness)
    try:
        outbox.put_nowait(generate_message(kv_ref, first))
        assert (await call.read()).request_ids[0] == "victim"
        outbox.put_nowait(decode_pb2.DecodeStreamRequest())  # neither generate nor abort
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            while True:
                await call.read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must carry generate or abort" in caught.value.details()
    finally:
        await channel.close()
    assert (await survivor).finish_reason is not None  # the other stream was not touched
    await harness.wait_for(
        lambda: harness.stats().num_running_requests == 0
    )  # the victim was aborted
    await harness.wait_all_pages_free()


async def test_a_running_request_past_its_deadline_ends_deadline_exceeded(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode()
    kv_ref, first = await harness.reserve_and_prefill("r", prompt_of(5, 1), LONG)
    channel, outbox, call = await open_stream(harness)
    try:
        outbox.put_nowait(generate_message(kv_ref, first, int((time.time() + 0.3) * 1000)))
        started = time.monotonic()
        while not (message := await call.read()).ends:
            pass
        (end,) = message.ends
        assert end.request_id == "r" and end.error.code == "DEADLINE_EXCEEDED"
        assert (
            end.error.error_type == "DeadlineExceededError" and time.monotonic() - started < WAIT_S
        )
        outbox.put_nowait(None)  # half-close: the stream ends, its requests all ended
        assert await call.read() == grpc.aio.EOF
    finally:
        await channel.close()
    await harness.wait_all_pages_free()


async def test_a_cancelled_stream_call_aborts_its_requests(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    kv_ref, first = await harness.reserve_and_prefill("r", prompt_of(5, 1), LONG)
    channel, outbox, call = await open_stream(harness)
    try:
        outbox.put_nowait(generate_message(kv_ref, first))
        await call.read()
        call.cancel()  # the router process went away
    finally:
        await channel.close()
    await harness.wait_for(lambda: harness.stats().num_running_requests == 0)
    await harness.wait_all_pages_free()
    assert not await harness.client.abort("r", "late")
