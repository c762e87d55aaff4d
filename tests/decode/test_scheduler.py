"""The decode scheduler alone: lifecycle, stop rules, joins and leaves, page accounting and quarantine."""

from __future__ import annotations

import msgspec
import pytest

from services.common.errors import CapacityError, InvalidRequestError, NotFoundError
from services.common.types import FinishReason, Usage
from services.decode.kv_manager import KVReservationManager
from services.decode.scheduler import DecodePlan, DecodeRequest, DecodeScheduler, ReqStatus, TokenEvent
from services.engine.kv_cache import KVPageManager, RequestPageTable
from services.engine.sampler import SamplingParams

EOS = 2
NUM_PAGES, PAGE_SIZE = 32, 4
QUARANTINE_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    max_model_len: int = 64, max_running: int = 8, quarantine_s: float = QUARANTINE_S, clock: FakeClock | None = None
) -> DecodeScheduler:
    kv = KVReservationManager(RequestPageTable(KVPageManager(NUM_PAGES, PAGE_SIZE)), quarantine_s, clock or FakeClock())
    return DecodeScheduler(kv, {EOS}, max_model_len, max_running)


def page_counts(scheduler: DecodeScheduler) -> tuple[int, int, int]:
    """(free, used, quarantined), checking that every page is exactly one of them."""
    kv = scheduler.kv
    assert kv.num_free_pages + kv.num_used_pages + kv.num_quarantined_pages == kv.num_total_pages
    return kv.num_free_pages, kv.num_used_pages, kv.num_quarantined_pages


def request(request_id: str, prompt_len: int = 5, delta: int = 0, **params: object) -> DecodeRequest:
    params.setdefault("max_new_tokens", 8)
    return DecodeRequest(request_id, tuple(range(10, 10 + prompt_len)), SamplingParams(**params), delta)


def started(scheduler: DecodeScheduler, *requests: DecodeRequest, first_token: int = 100) -> None:
    for r in requests:
        scheduler.add(r)
        assert scheduler.start(r.request_id, first_token) is None


def test_reserve_takes_pages_for_prompt_plus_max_new_tokens_capped_by_context() -> None:
    scheduler = make_scheduler(max_model_len=20)
    assert len(scheduler.add(request("a", prompt_len=5, max_new_tokens=8))) == 4  # 13 positions
    assert len(scheduler.add(request("b", prompt_len=10, max_new_tokens=100))) == 5  # capped at 20
    assert scheduler.kv.num_free_pages == NUM_PAGES - 9
    assert scheduler.num_reserved == 2 and scheduler.status("a") is ReqStatus.RESERVED
    with pytest.raises(InvalidRequestError, match="already live"):
        scheduler.add(request("a"))
    for i in range(4):
        scheduler.add(request(f"fill-{i}", prompt_len=19, max_new_tokens=200))  # 5 pages each
    with pytest.raises(CapacityError, match="needs 5 KV pages, 3 of 32 are free"):
        scheduler.add(request("c", prompt_len=19, max_new_tokens=200))
    assert "c" not in scheduler and scheduler.kv.num_free_pages == 3
    assert scheduler.abort("a") and not scheduler.abort("a")
    assert scheduler.kv.num_free_pages == 7


def test_plan_feeds_the_last_token_at_seq_len_plus_delta() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", prompt_len=5, delta=-3))
    plan = scheduler.schedule()
    (item,) = plan.items
    assert (item.token_id, item.seq_len, item.position, item.is_new) == (100, 5, 2, True)
    assert item.prompt_ids == item.output_ids == ()  # no penalties: no history shipped
    assert scheduler.update_from_output(plan, [7]) == [TokenEvent("a", (7,))]
    (item,) = scheduler.schedule().items
    assert (item.token_id, item.seq_len, item.position, item.is_new) == (7, 6, 3, False)


def test_penalized_requests_carry_their_history() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", prompt_len=3, repetition_penalty=1.2))
    (item,) = scheduler.schedule().items
    assert item.prompt_ids == (10, 11, 12) and item.output_ids == (100,)


@pytest.mark.parametrize(
    ("params", "tokens", "reason"),
    [
        ({}, [7, EOS], FinishReason.STOP),
        ({"stop_token_ids": (9,)}, [7, 9], FinishReason.STOP),
        ({"ignore_eos": True, "max_new_tokens": 3}, [EOS, 7], FinishReason.LENGTH),
        ({"max_new_tokens": 3}, [7, 8], FinishReason.LENGTH),  # the first token counts
    ],
)
def test_stop_rules(params: dict, tokens: list[int], reason: FinishReason) -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", **params))
    events = []
    for token in tokens:
        events += scheduler.update_from_output(scheduler.schedule(), [token])
    assert events[-1] == TokenEvent("a", (tokens[-1],), reason, Usage(5, 1 + len(tokens)))
    assert "a" not in scheduler and scheduler.kv.num_free_pages == NUM_PAGES
    assert not scheduler.schedule().items


def test_context_limit_is_a_length_finish() -> None:
    scheduler = make_scheduler(max_model_len=8)
    started(scheduler, request("a", prompt_len=6, max_new_tokens=100))
    events = scheduler.update_from_output(scheduler.schedule(), [7])
    assert events == [TokenEvent("a", (7,), FinishReason.LENGTH, Usage(6, 2))]


@pytest.mark.parametrize(("params", "reason"), [({"max_new_tokens": 1}, "length"), ({}, "stop")])
def test_first_token_may_finish_at_once(params: dict, reason: str) -> None:
    scheduler = make_scheduler()
    scheduler.add(request("a", **params))
    event = scheduler.start("a", EOS if reason == "stop" else 100)
    assert event == TokenEvent("a", (), FinishReason(reason), Usage(5, 1))
    assert scheduler.kv.num_free_pages == NUM_PAGES and not scheduler.has_work


def test_start_needs_a_reserved_request() -> None:
    scheduler = make_scheduler()
    with pytest.raises(NotFoundError):
        scheduler.start("nope", 1)
    started(scheduler, request("a"))
    with pytest.raises(InvalidRequestError, match="already started"):
        scheduler.start("a", 1)


def test_requests_join_and_leave_at_every_step() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", max_new_tokens=3))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, [7])
    started(scheduler, request("b"))
    plan = scheduler.schedule()
    assert [(i.request_id, i.is_new) for i in plan.items] == [("a", False), ("b", True)]
    events = scheduler.update_from_output(plan, [8, 9])
    assert events[0].finish_reason is FinishReason.LENGTH and events[1] == TokenEvent("b", (9,))
    plan = scheduler.schedule()
    assert [i.request_id for i in plan.items] == ["b"] and plan.released_request_ids == ("a",)
    assert scheduler.schedule().released_request_ids == ()


def test_max_running_requests_holds_the_rest_waiting() -> None:
    scheduler = make_scheduler(max_running=2)
    started(scheduler, request("a", max_new_tokens=2), request("b"), request("c"))
    plan = scheduler.schedule()
    assert [i.request_id for i in plan.items] == ["a", "b"] and scheduler.num_running == 3
    scheduler.update_from_output(plan, [7, 7])  # a finishes
    assert [i.request_id for i in scheduler.schedule().items] == ["b", "c"]


def test_abort_during_a_step_frees_pages_only_after_it() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a"), request("b"))
    plan = scheduler.schedule()
    assert scheduler.abort("a")
    assert scheduler.kv.num_used_pages == 8  # a's step still writes its KV
    with pytest.raises(InvalidRequestError):
        scheduler.add(request("a"))  # its pages are not back yet
    assert scheduler.update_from_output(plan, [7, 8]) == [TokenEvent("b", (8,))]
    assert scheduler.kv.num_used_pages == 4
    assert scheduler.schedule().released_request_ids == ("a",)


def test_abort_all_frees_everything() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a"), request("b"))
    scheduler.add(request("c"))
    scheduler.schedule()
    assert sorted(scheduler.abort_all()) == ["a", "b", "c"]
    assert scheduler.kv.num_free_pages == NUM_PAGES and scheduler.num_reserved == scheduler.num_running == 0


def test_plan_and_events_round_trip_through_msgpack() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", repetition_penalty=1.1, seed=3))
    plan = scheduler.schedule()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=DecodePlan) == plan
    event = TokenEvent("a", (1, 2), FinishReason.STOP, Usage(3, 4))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=TokenEvent) == event


def test_quarantined_pages_come_back_only_after_the_quarantine() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(clock=clock)
    scheduler.add(request("a"))  # 13 positions: 4 pages
    scheduler.add(request("b"))
    assert page_counts(scheduler) == (NUM_PAGES - 8, 8, 0)
    assert scheduler.abort("a", quarantine=True)  # its transfer failed: a late write may still land
    assert "a" not in scheduler and scheduler.num_reserved == 1
    assert page_counts(scheduler) == (NUM_PAGES - 8, 4, 4)
    clock.now += 4.0
    assert scheduler.abort("b", quarantine=True)
    assert page_counts(scheduler) == (NUM_PAGES - 8, 0, 8)
    scheduler.add(request("a"))  # the id is free again; the quarantined pages are not reused
    assert page_counts(scheduler) == (NUM_PAGES - 12, 4, 8)
    clock.now += QUARANTINE_S - 4.0 - 0.001
    assert scheduler.kv.release_quarantined() == 0
    assert page_counts(scheduler) == (NUM_PAGES - 12, 4, 8)
    clock.now += 0.001  # a's quarantine is over, b's is not
    assert scheduler.kv.release_quarantined() == 4
    assert page_counts(scheduler) == (NUM_PAGES - 8, 4, 4)
    clock.now += 4.0
    assert scheduler.kv.release_quarantined() == 4
    assert scheduler.abort("a")
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0)
    assert scheduler.kv.release_quarantined() == 0


def test_quarantined_pages_cannot_be_allocated() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_model_len=128, clock=clock)
    scheduler.add(request("a", prompt_len=20, max_new_tokens=100))  # 30 pages
    scheduler.abort("a", quarantine=True)
    with pytest.raises(CapacityError, match="needs 4 KV pages, 2 of 32 are free \\(30 in quarantine\\)"):
        scheduler.add(request("b"))
    clock.now += QUARANTINE_S
    scheduler.kv.release_quarantined()
    assert len(scheduler.add(request("b"))) == 4


def test_aborts_without_quarantine_free_at_once() -> None:
    scheduler = make_scheduler()
    scheduler.add(request("reserved"))  # the caller knows its KV is written (or none was ever sent)
    started(scheduler, request("running-1"), request("running-2"))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, [7, 7])
    started(scheduler, request("waiting"))
    assert scheduler.status("running-1") is ReqStatus.RUNNING and scheduler.status("waiting") is ReqStatus.WAITING
    assert page_counts(scheduler) == (NUM_PAGES - 16, 16, 0)
    for request_id in ("reserved", "running-1", "waiting", "running-2"):
        assert scheduler.abort(request_id)
        assert page_counts(scheduler)[2] == 0
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0)


def test_quarantine_of_zero_seconds_frees_at_once() -> None:
    scheduler = make_scheduler(quarantine_s=0.0)
    scheduler.add(request("a"))
    assert scheduler.abort("a", quarantine=True)
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0)


def test_abort_all_frees_reservations_at_once_and_keeps_the_quarantine() -> None:
    scheduler = make_scheduler()
    scheduler.add(request("a"))
    scheduler.add(request("b"))
    scheduler.abort("a", quarantine=True)
    assert scheduler.abort_all() == ["b"]
    assert page_counts(scheduler) == (NUM_PAGES - 4, 0, 4)
