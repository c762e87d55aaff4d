"""The decode scheduler alone: lifecycle, stop rules, joins and leaves, reading one step late,
page and slot accounting, expiry and quarantine."""

from __future__ import annotations

import pytest

from services.common.errors import CapacityError, InvalidRequestError, NotFoundError
from services.common.types import FinishReason, SamplingParams, Usage
from services.decode.kv_manager import KVReservationManager
from services.decode.messages import Finished
from services.decode.scheduler import DecodeRequest, DecodeScheduler, ReqStatus
from services.engine.kv_cache import KVPageManager, RequestPageTable

EOS = 2
NUM_PAGES, PAGE_SIZE = 32, 4
QUARANTINE_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    max_model_len: int = 64,
    max_running: int = 8,
    quarantine_s: float = QUARANTINE_S,
    clock: FakeClock | None = None,
) -> DecodeScheduler:
    kv = KVReservationManager(
        RequestPageTable(KVPageManager(NUM_PAGES, PAGE_SIZE)), quarantine_s, clock or FakeClock()
    )
    return DecodeScheduler(kv, {EOS}, max_model_len, max_running)


def page_counts(scheduler: DecodeScheduler) -> tuple[int, int, int]:
    """(free, used, quarantined), checking that every page is exactly one of them."""
    kv = scheduler.kv
    assert kv.num_free_pages + kv.num_used_pages + kv.num_quarantined_pages == kv.num_total_pages
    return kv.num_free_pages, kv.num_used_pages, kv.num_quarantined_pages


def request(
    request_id: str,
    prompt_len: int = 5,
    delta: int = 0,
    deadline_mono: float = 1e9,
    **params: object,
) -> DecodeRequest:
    params.setdefault("max_new_tokens", 8)
    return DecodeRequest(
        request_id,
        tuple(range(10, 10 + prompt_len)),
        SamplingParams(**params),
        delta,
        deadline_mono,
    )


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
    assert scheduler.abort("a", is_kv_written=True) and not scheduler.abort("a")
    assert scheduler.kv.num_free_pages == 7


class Steps:
    """Drives the scheduler as the rank's loop does: plan, then read a step (late or at once)."""

    def __init__(self, scheduler: DecodeScheduler) -> None:
        self.scheduler = scheduler
        self.next_step = 0

    def plan(self):
        plan = self.scheduler.schedule(self.next_step)
        self.next_step += 1
        return plan

    def read(self, plan, tokens: list[int]):
        return self.scheduler.update_from_output(plan, tokens)


def test_plan_feeds_the_newest_token_at_seq_len_plus_delta() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", prompt_len=5, delta=-3))
    steps = Steps(scheduler)
    plan = steps.plan()
    assert plan.request_ids == ("a",) and len(plan.joined) == 1
    assert (plan.seq_lens.tolist(), plan.positions.tolist(), plan.num_output_ids.tolist()) == (
        [5],
        [2],
        [1],
    )
    (joined,) = plan.joined
    assert (joined.first_token_id, joined.prompt_ids, joined.pages) == (
        100,
        (),
        scheduler.kv.pages("a"),
    )
    assert steps.read(plan, [7]) == ([("a", 7)], [])
    plan = steps.plan()
    assert (plan.seq_lens.tolist(), plan.positions.tolist(), plan.joined) == ([6], [3], ())


def test_penalized_requests_ship_their_prompt_once() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a", prompt_len=3, repetition_penalty=1.2))
    (joined,) = Steps(scheduler).plan().joined
    assert joined.prompt_ids == (10, 11, 12)


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
    steps = Steps(scheduler)
    finished = []
    for token in tokens:
        finished += steps.read(steps.plan(), [token])[1]
    assert finished == [Finished("a", reason, Usage(5, 1 + len(tokens)))]
    assert "a" not in scheduler and scheduler.kv.num_free_pages == NUM_PAGES
    assert steps.plan() is None and scheduler.slots.num_free == scheduler.slots.num_slots


def test_context_limit_is_a_length_finish() -> None:
    scheduler = make_scheduler(max_model_len=8)
    started(scheduler, request("a", prompt_len=6, max_new_tokens=100))
    steps = Steps(scheduler)
    assert steps.read(steps.plan(), [7]) == (
        [("a", 7)],
        [Finished("a", FinishReason.LENGTH, Usage(6, 2))],
    )


def test_read_one_step_late_a_stop_drops_the_next_token_and_no_step_passes_the_length() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("eos"), request("short", max_new_tokens=3))
    steps = Steps(scheduler)
    first = steps.plan()
    second = steps.plan()  # planned before the first is read, as the overlapped loop does
    assert second.request_ids == ("eos", "short") and second.seq_lens.tolist() == [6, 6]
    tokens, finished = steps.read(first, [EOS, 7])
    assert tokens == [("eos", EOS), ("short", 7)] and [f.request_id for f in finished] == ["eos"]
    assert scheduler.kv.num_used_pages == 4 + 2  # "eos" still runs in the second step
    assert steps.plan() is None  # "short" has every token launched
    tokens, finished = steps.read(second, [9, 8])  # 9: after the stop, never streamed
    assert tokens == [("short", 8)] and finished == [
        Finished("short", FinishReason.LENGTH, Usage(5, 3))
    ]
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0) and not scheduler.has_work


@pytest.mark.parametrize(("params", "reason"), [({"max_new_tokens": 1}, "length"), ({}, "stop")])
def test_first_token_may_finish_at_once(params: dict, reason: str) -> None:
    scheduler = make_scheduler()
    scheduler.add(request("a", **params))
    done = scheduler.start("a", EOS if reason == "stop" else 100)
    assert done == Finished("a", FinishReason(reason), Usage(5, 1))
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
    steps = Steps(scheduler)
    steps.read(steps.plan(), [7])
    started(scheduler, request("b"))
    plan = steps.plan()
    assert plan.request_ids == ("a", "b") and [j.slot for j in plan.joined] == [plan.slots[1]]
    _, finished = steps.read(plan, [8, 9])
    assert [f.request_id for f in finished] == ["a"]
    assert steps.plan().request_ids == ("b",)


def test_max_running_requests_holds_the_rest_waiting() -> None:
    scheduler = make_scheduler(max_running=2)
    started(scheduler, request("a", max_new_tokens=2), request("b"), request("c"))
    steps = Steps(scheduler)
    plan = steps.plan()
    assert plan.request_ids == ("a", "b") and scheduler.num_running == 3
    steps.read(plan, [7, 7])  # a finishes: its slot is free again
    assert steps.plan().request_ids == ("b", "c")


def test_abort_during_a_step_frees_pages_and_slot_only_after_it() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a"), request("b"))
    steps = Steps(scheduler)
    plan = steps.plan()
    assert scheduler.abort("a")
    assert (
        scheduler.kv.num_used_pages == 8 and scheduler.slots.num_free == 6
    )  # a's step still writes them
    with pytest.raises(InvalidRequestError):
        scheduler.add(request("a"))  # its pages are not back yet
    assert steps.read(plan, [7, 8]) == ([("b", 8)], [])
    assert scheduler.kv.num_used_pages == 4 and scheduler.slots.num_free == 7


def test_expired_reservations_are_quarantined() -> None:
    scheduler = make_scheduler()
    scheduler.add(request("late", deadline_mono=5.0))
    scheduler.add(request("later", deadline_mono=9.0))
    assert scheduler.expire(4.9) == []
    assert scheduler.expire(5.0) == ["late"]
    assert scheduler.status("late") is None and page_counts(scheduler) == (NUM_PAGES - 8, 4, 4)
    started(scheduler, request("started", deadline_mono=1.0))  # started in time: no expiry
    assert scheduler.expire(10.0) == ["later"]
    assert scheduler.status("started") is ReqStatus.WAITING


def test_abort_all_ends_everything_and_a_reset_drops_the_unread_steps() -> None:
    scheduler = make_scheduler()
    started(scheduler, request("a"), request("b"))
    scheduler.add(request("c"))
    steps = Steps(scheduler)
    plan = steps.plan()
    assert sorted(scheduler.abort_all()) == ["a", "b", "c"]
    assert page_counts(scheduler) == (NUM_PAGES - 12, 8, 4)  # the running two wait for their step
    scheduler.drop_unread(plan.step)
    assert page_counts(scheduler) == (NUM_PAGES - 4, 0, 4) and scheduler.slots.num_free == 8
    assert scheduler.num_reserved == scheduler.num_running == 0 and not scheduler.has_work


def test_quarantined_pages_come_back_only_after_the_quarantine() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(clock=clock)
    scheduler.add(request("a"))  # 13 positions: 4 pages
    scheduler.add(request("b"))
    assert page_counts(scheduler) == (NUM_PAGES - 8, 8, 0)
    assert scheduler.abort("a")  # reserved, its KV not known written: a late write may still land
    assert "a" not in scheduler and scheduler.num_reserved == 1
    assert page_counts(scheduler) == (NUM_PAGES - 8, 4, 4)
    clock.now += 4.0
    assert scheduler.abort("b")
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
    assert scheduler.abort("a", is_kv_written=True)
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0)
    assert scheduler.kv.release_quarantined() == 0


def test_quarantined_pages_cannot_be_allocated() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_model_len=128, clock=clock)
    scheduler.add(request("a", prompt_len=20, max_new_tokens=100))  # 30 pages
    scheduler.abort("a")
    with pytest.raises(
        CapacityError, match="needs 4 KV pages, 2 of 32 are free \\(30 in quarantine\\)"
    ):
        scheduler.add(request("b"))
    clock.now += QUARANTINE_S
    scheduler.kv.release_quarantined()
    assert len(scheduler.add(request("b"))) == 4


def test_only_reservations_not_known_written_are_quarantined() -> None:
    scheduler = make_scheduler()
    scheduler.add(request("reserved"))  # the caller knows its KV is written (or none was ever sent)
    started(scheduler, request("running-1"), request("running-2"))
    steps = Steps(scheduler)
    steps.read(steps.plan(), [7, 7])
    started(scheduler, request("waiting"))
    assert (
        scheduler.status("running-1") is ReqStatus.RUNNING
        and scheduler.status("waiting") is ReqStatus.WAITING
    )
    assert page_counts(scheduler) == (NUM_PAGES - 16, 16, 0)
    assert scheduler.abort("reserved", is_kv_written=True)
    for request_id in (
        "running-1",
        "waiting",
        "running-2",
    ):  # past generate: freed whatever is_kv_written says
        assert scheduler.abort(request_id)
        assert page_counts(scheduler)[2] == 0
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0)


def test_quarantine_of_zero_seconds_frees_at_once() -> None:
    scheduler = make_scheduler(quarantine_s=0.0)
    scheduler.add(request("a"))
    assert scheduler.abort("a")
    assert page_counts(scheduler) == (NUM_PAGES, 0, 0)
