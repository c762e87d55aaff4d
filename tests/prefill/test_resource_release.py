"""A bug's exception in the leader fails the request it hit and releases what that request held."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.common.errors import StageServeError
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
    other = standard_cases(pipeline)[1]  # pumps that would run a request left behind
    result, _ = await harness.prefill(other)
    assert result.first_token_id >= 0
    assert raised and sends == [other.request.request_id]
    harness.assert_all_free()


async def test_a_deadline_pump_that_fails_is_tried_again(pipeline, harness: Harness) -> None:
    """With no event to drive it, the pump armed for a deadline survives a failing pump."""
    leader, scheduler = harness.app.leader, harness.scheduler
    expire, num_failed, num_ok = scheduler.expire, [0], [0]

    def expire_failing_three_times():
        if num_failed[0] < 3:
            num_failed[0] += 1
            raise RuntimeError("scheduler bug")
        num_ok[0] += 1
        return expire()

    scheduler.expire = expire_failing_three_times
    leader._arm(leader._clock())  # a deadline that is due now
    await wait_until(lambda: num_ok[0] >= 1)
    assert num_failed[0] == 3
    scheduler.expire = expire
    result, _ = await harness.prefill(standard_cases(pipeline)[0])
    assert result.kv_written_proof
    harness.assert_all_free()
