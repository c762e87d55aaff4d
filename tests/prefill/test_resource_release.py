"""A bug's exception in the leader fails the request it hit and releases what that request held."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from services.common.errors import StageServeError
from services.prefill.leader import TICK_S
from tests.prefill.conftest import Harness, record_sends, standard_cases, wait_until


def gauge(name: str) -> float:
    return REGISTRY.get_sample_value(f"stageserve_prefill_{name}") or 0.0


class BrokenEncoder:
    """An encoder client with a bug: every call raises something that is not a StageServeError."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def encode(self, *args: object, **kwargs: object) -> list:
        self.num_calls += 1
        raise RuntimeError("encoder client bug")


async def test_an_unexpected_encoder_error_fails_the_request_and_frees_rows_and_slot(
    pipeline, harness: Harness
) -> None:
    leader = harness.app.leader
    real_encoder, broken = leader.encoder, BrokenEncoder()
    leader.encoder = broken
    try:
        with pytest.raises(StageServeError, match="internal error") as caught:
            await harness.prefill(standard_cases(pipeline)[2], deadline_in_s=20.0)
    finally:
        leader.encoder = real_encoder
    assert type(caught.value) is StageServeError and caught.value.grpc_code == "INTERNAL"
    assert broken.num_calls == 1 and "RuntimeError" in caught.value.message
    harness.assert_all_free()  # rows (quarantine 0 here), queue slot, pages
    assert gauge("embedding_rows_used") == 0 and gauge("queued_requests") == 0
    case = standard_cases(pipeline)[1]  # the service keeps serving image requests
    result, _ = await harness.prefill(case)
    assert result.first_token_id >= 0
    harness.assert_all_free()


async def test_an_error_on_the_callers_path_drops_its_request(pipeline, harness: Harness) -> None:
    """The scheduler raises on the caller's own pump: the caller gets an error and its request
    is gone (it neither runs later nor writes KV)."""
    sends = record_sends(harness)
    scheduler = harness.scheduler
    admit, raised = scheduler.admit, []

    def admit_failing_once():
        entry = scheduler.get("text")
        if not raised and entry is not None:
            raised.append(True)
            raise RuntimeError("scheduler bug")
        return admit()

    scheduler.admit = admit_failing_once
    with pytest.raises(StageServeError, match="internal error in PrefillServicer.Prefill"):
        await harness.prefill(standard_cases(pipeline)[0])
    expire, num_ticks = scheduler.expire, [0]

    def expire_counting():
        num_ticks[0] += 1
        return expire()

    scheduler.expire = expire_counting
    await wait_until(lambda: num_ticks[0] >= 10)  # pumps that would run a request left behind
    assert raised and sends == []
    harness.assert_all_free()


async def test_the_ticker_survives_a_failing_tick(pipeline, harness: Harness) -> None:
    scheduler = harness.scheduler
    expire, num_failed, num_ok = scheduler.expire, [0], [0]

    def expire_failing():
        num_failed[0] += 1
        raise RuntimeError("scheduler bug")

    scheduler.expire = expire_failing
    deadline = time.monotonic() + 10
    while num_failed[0] < 3:  # the ticker pumped three times through the failure
        assert time.monotonic() < deadline, "the ticker stopped pumping"
        await asyncio.sleep(TICK_S)

    def expire_counting():
        num_ok[0] += 1
        return expire()

    scheduler.expire = expire_counting
    while num_ok[0] < 2:  # still ticking with no request to drive it
        assert time.monotonic() < deadline, "the ticker died on the failing tick"
        await asyncio.sleep(TICK_S)
    result, _ = await harness.prefill(standard_cases(pipeline)[0])
    assert result.kv_written_proof
    harness.assert_all_free()
