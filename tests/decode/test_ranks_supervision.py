"""Decode rank processes that step by themselves: a reservation expires and its pages come
back from quarantine with no command sent to the rank (its own timers), and a rank frozen
with SIGSTOP mid-stream is found hung (no report within ``--watchdog-s`` while it has work):
its requests end UNAVAILABLE in bounded time, the other rank's finish, and it restarts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.common.errors import UnavailableError
from services.common.types import SamplingParams
from services.engine.llm import EngineRequest
from tests.decode.conftest import prompt_of
from tests.decode.test_ranks import (
    BOUND_S,
    Decode,
    Prefill,
    all_running,
    decode_process,
    generate,
    make_pipeline,
    wait_idle,
)

pytestmark = pytest.mark.slow
WATCHDOG_S = 3.0


@pytest.fixture(scope="module")
def decode(tmp_path_factory) -> Iterator[Decode]:
    log_path = tmp_path_factory.mktemp("decode-supervision") / "decode.log"
    flags = ("--transfer-backend", "shm", "--watchdog-s", str(WATCHDOG_S))
    with decode_process(2, log_path, *flags) as running:
        yield running


async def test_a_reservation_expires_and_its_pages_return_with_no_command(decode) -> None:
    client = decode.client()
    try:
        await wait_idle(decode, client)
        kv_ref = await client.reserve(
            "expiring", prompt_of(6, 1), 0, SamplingParams(max_new_tokens=8), time.time() + 1.0
        )
        stats = await client.stats()
        assert stats.ranks[kv_ref.dp_rank].num_reserved_requests == 1
        deadline_mono = time.monotonic() + BOUND_S
        while (await client.stats()).ranks[kv_ref.dp_rank].num_reserved_requests:
            assert time.monotonic() < deadline_mono, "the reservation did not expire"
            await asyncio.sleep(0.05)
        await wait_idle(decode, client)  # its pages back from quarantine, still no command
    finally:
        await client.close()


async def test_a_rank_frozen_mid_stream_is_found_hung_and_restarts(decode) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    requests = [EngineRequest(f"frozen-{i}", prompt_of(5, 300 + i), params) for i in range(6)]
    prefill, client = Prefill(make_pipeline().engine), decode.client()
    try:
        tasks = await all_running(client, prefill, requests)
        victim = decode.rank_pids()[0]
        os.kill(victim, signal.SIGSTOP)  # the leader kills it (SIGKILL ends a stopped process)
        frozen_at = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), BOUND_S)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        finished = [o for o in outcomes if not isinstance(o, BaseException)]
        assert failed and finished, outcomes
        assert all(
            isinstance(o, UnavailableError) and "sent no report" in o.message for o in failed
        ), failed
        assert time.monotonic() - frozen_at < BOUND_S
        for tokens, reason, _ in finished:  # the other rank's streams are whole
            assert (len(tokens), reason) == (300, "length")
        await wait_idle(decode, client)  # restarted: serving again, its pool whole
        assert victim not in decode.rank_pids() and len(decode.rank_pids()) == 2
        tokens, reason, _ = await generate(
            client, prefill, EngineRequest("after-frozen", prompt_of(5, 1), params)
        )
        assert (len(tokens), reason) == (300, "length")
    finally:
        await client.close()
