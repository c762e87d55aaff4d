"""Prefill scheduler bookkeeping: lifecycle, batch packing, the batch-kind rule, rows and deadlines."""

from __future__ import annotations

import msgspec
import pytest

from services.common.destinations import KvDestination, KvPoolLayout
from services.common.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    UnavailableError,
)
from services.common.types import ImageSpanRef, SamplingParams
from services.prefill.request import (
    BatchKind,
    PlannedRequest,
    PrefillInput,
    PrefillOutput,
    PrefillPlan,
    PrefillStatus,
    RequestOutcome,
    can_share_batch,
)
from services.prefill.scheduler import PrefillScheduler
from services.transfer.embeddings import EmbeddingRowManager

LAYOUT = KvPoolLayout(0, 0, 1, 8, 4, 1, 8, "float32", 128)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_input(
    request_id: str,
    num_tokens: int,
    num_image_tokens: int = 0,
    deadline_mono: float = 1e9,
    kind: BatchKind | None = None,
) -> PrefillInput:
    spans = (
        (ImageSpanRef(1, num_image_tokens, "h", (1, 2, 2 * num_image_tokens)),)
        if num_image_tokens
        else ()
    )
    if kind is None:
        kind = BatchKind.IMAGE if num_image_tokens else BatchKind.TEXT
    dst = KvDestination("inprocess", "s", request_id, LAYOUT, ())
    return PrefillInput(
        request_id, (1,) * num_tokens, spans, SamplingParams(), dst, deadline_mono, kind
    )


def make_scheduler(
    num_rows: int = 64, num_pages: int = 32, max_batch_tokens: int = 64, **kwargs
) -> PrefillScheduler:
    return PrefillScheduler(EmbeddingRowManager(num_rows), num_pages, 4, max_batch_tokens, **kwargs)


def ok_output(plan: PrefillPlan) -> PrefillOutput:
    return PrefillOutput(
        plan.plan_id, tuple(RequestOutcome(i, first_token_id=7) for i in plan.request_ids), 0.0
    )


def test_batch_kind_rule() -> None:
    assert can_share_batch(BatchKind.TEXT, BatchKind.IMAGE)
    assert can_share_batch(BatchKind.TEXT, BatchKind.EMBEDDING_OVERRIDE)
    assert not can_share_batch(BatchKind.IMAGE, BatchKind.EMBEDDING_OVERRIDE)
    assert not can_share_batch(BatchKind.EMBEDDING_OVERRIDE, BatchKind.IMAGE)
    for kind in BatchKind:
        assert can_share_batch(kind, kind)


def test_scheduler_never_mixes_image_and_embedding_override() -> None:
    s = make_scheduler()
    s.add(make_input("img", 8, num_image_tokens=2), {"h": b"x"})
    s.add(make_input("emb", 8, kind=BatchKind.EMBEDDING_OVERRIDE), {})
    s.add(make_input("txt", 8), {})
    s.add(make_input("emb2", 8, kind=BatchKind.EMBEDDING_OVERRIDE), {})
    [encoding] = s.admit()
    assert encoding.request_id == "img"
    assert s.finish_encoding("img") is None
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["img", "txt"]
    s.update_from_output(plan, ok_output(plan))
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["emb", "emb2"]


def test_embedding_override_first_keeps_images_out() -> None:
    s = make_scheduler()
    s.add(make_input("emb", 8, kind=BatchKind.EMBEDDING_OVERRIDE), {})
    s.add(make_input("img", 8, num_image_tokens=2), {"h": b"x"})
    s.add(make_input("txt", 8), {})
    s.admit()
    s.finish_encoding("img")
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["emb", "txt"]
    assert {r.request.kind for r in plan.requests} == {BatchKind.EMBEDDING_OVERRIDE, BatchKind.TEXT}


def test_lifecycle_rows_and_one_plan_in_flight() -> None:
    s = make_scheduler(num_rows=10)
    s.add(make_input("a", 12, num_image_tokens=6), {"h": b"x"})
    s.add(make_input("b", 12, num_image_tokens=6), {"h": b"x"})  # does not fit the 4 rows left
    s.add(make_input("t", 5), {})
    encoding = s.admit()
    assert [e.request_id for e in encoding] == ["a"]
    assert [s.get(i).status for i in "abt"] == [
        PrefillStatus.ENCODING,
        PrefillStatus.QUEUED,
        PrefillStatus.READY,
    ]
    assert s.get("a").row_start == 0 and s.num_rows_used == 6
    s.finish_encoding("a", num_cached_image_tokens=6)
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["a", "t"]
    assert plan.requests[0] == PlannedRequest(s.get("a").input, 0)
    assert s.schedule() is None  # one plan in flight
    assert s.admit() == []  # b waits for a's rows
    outcomes = s.update_from_output(plan, ok_output(plan))
    assert [(o.request_id, o.first_token_id, o.num_cached_image_tokens) for o in outcomes] == [
        ("a", 7, 6),
        ("t", 7, 0),
    ]
    assert s.num_live == 1 and s.num_rows_used == 0
    assert [e.request_id for e in s.admit()] == ["b"]  # rows are free again


def test_a_re_formed_group_fails_the_requests_holding_rows() -> None:
    s = make_scheduler(num_rows=20)
    s.add(make_input("ready", 12, num_image_tokens=6), {"h": b"x"})
    s.add(make_input("encoding", 12, num_image_tokens=6), {"h": b"x"})
    s.add(make_input("text", 5), {})
    s.admit()
    s.finish_encoding("ready")
    gone = UnavailableError("rows gone")
    assert [o.request_id for o in s.fail_row_holders(gone)] == ["ready"]
    outcome = s.finish_encoding("encoding")  # its Encode returns: it fails too
    assert outcome is not None and outcome.error is gone
    assert s.num_rows_used == 0 and [e.request_id for e in s._entries.values()] == ["text"]


def test_max_batch_tokens_and_pool_limit_the_plan() -> None:
    s = make_scheduler(num_pages=8, max_batch_tokens=20)
    for request_id, n in (("a", 12), ("b", 12), ("c", 8), ("d", 4)):
        s.add(make_input(request_id, n), {})
    s.admit()
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["a", "c"]  # 20 tokens; b would make 24
    s.update_from_output(plan, ok_output(plan))
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["b", "d"]


def test_a_prompt_longer_than_the_token_budget_runs_alone() -> None:
    s = make_scheduler(num_pages=32, max_batch_tokens=8)
    s.add(make_input("long", 30), {})
    s.add(make_input("short", 2), {})
    s.admit()
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["long"]


def test_add_refuses_what_can_never_run_and_a_full_queue() -> None:
    s = make_scheduler(num_rows=4, num_pages=4, max_queued=2)
    with pytest.raises(InvalidRequestError, match="holds at most 16"):
        s.add(make_input("long", 17), {})
    with pytest.raises(InvalidRequestError, match="embedding buffer holds 4"):
        s.add(make_input("big", 8, num_image_tokens=5), {"h": b"x"})
    s.add(make_input("a", 4), {})
    with pytest.raises(InvalidRequestError, match="already"):
        s.add(make_input("a", 4), {})
    s.add(make_input("b", 4), {})
    with pytest.raises(CapacityError):
        s.add(make_input("c", 4), {})


def test_saturation_is_the_fuller_of_the_queue_and_the_tokens_waiting_for_a_batch() -> None:
    s = make_scheduler(num_pages=32, max_batch_tokens=64, max_queued=8)
    assert s.saturation == 0.0
    s.add(make_input("a", 16), {})
    assert s.saturation == pytest.approx(16 / 64)  # tokens: a quarter of a batch waits
    s.add(make_input("b", 32), {})
    s.admit()
    assert s.saturation == pytest.approx(48 / 64)
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["a", "b"]
    assert s.saturation == pytest.approx(2 / 8)  # running: only their queue places count
    for request_id in "cde":
        s.add(make_input(request_id, 12), {})
    assert s.saturation == pytest.approx(5 / 8)  # the queue: 36 tokens wait
    s.add(make_input("f", 40), {})
    assert s.saturation == 1.0  # 76 tokens: more than a whole batch waits
    s.update_from_output(plan, ok_output(plan))
    assert s.num_live == 4 and s.saturation == 1.0


def test_encoder_failure_frees_rows_and_timeouts_quarantine_them() -> None:
    clock = Clock()
    s = make_scheduler(num_rows=8, row_quarantine_s=5.0, clock=clock)
    s.add(make_input("bad", 8, num_image_tokens=4), {"h": b"x"})
    s.add(make_input("slow", 8, num_image_tokens=4), {"h": b"x"})
    assert len(s.admit()) == 2 and s.num_rows_used == 8
    outcome = s.finish_encoding("bad", UnavailableError("encoder down"))
    assert outcome is not None and isinstance(outcome.error, UnavailableError)
    assert s.num_rows_used == 4
    s.finish_encoding("slow", DeadlineExceededError("late"), may_still_write=True)
    assert s.num_rows_used == 4 and s.num_live == 0  # quarantined, not free
    assert s.next_wake() == clock.now + 5.0  # the leader's pump is armed for the release
    clock.now += 5.0
    s.expire()  # the pump at the release time: rows free even while nothing can be admitted
    assert s.num_rows_used == 0 and s.rows.num_free_rows == 8
    assert s.next_wake() is None


def test_next_wake_is_the_earliest_waiting_deadline() -> None:
    clock = Clock()
    s = make_scheduler(clock=clock)
    assert s.next_wake() is None
    s.add(make_input("late", 4, deadline_mono=clock.now + 9), {})
    s.add(make_input("soon", 4, deadline_mono=clock.now + 2), {})
    s.add(make_input("encoding", 4, num_image_tokens=2, deadline_mono=clock.now + 1), {"h": b"x"})
    s.admit()  # "encoding" waits on its Encode (the caller's own deadline ends it), not a pump
    assert s.next_wake() == clock.now + 2
    clock.now += 2
    assert [o.request_id for o in s.expire()] == ["soon"]
    assert s.next_wake() == clock.now + 7


def test_abort_and_expire() -> None:
    clock = Clock()
    s = make_scheduler(clock=clock)
    s.add(make_input("queued", 4, deadline_mono=clock.now + 1), {})
    s.add(make_input("encoding", 4, num_image_tokens=2), {"h": b"x"})
    s.add(make_input("running", 4), {})
    s.admit()
    # "queued" is READY now; "running" too; plan takes both text requests
    plan = s.schedule()
    assert plan is not None and plan.request_ids == ["queued", "running"]
    s.abort("running", DeadlineExceededError("gone"))
    s.abort("encoding", DeadlineExceededError("gone"))
    assert s.get("running").status is PrefillStatus.RUNNING  # finishes with its plan
    assert s.get("encoding").status is PrefillStatus.ENCODING  # rows stay until the Encode returns
    outcomes = s.update_from_output(plan, ok_output(plan))
    assert [o.request_id for o in outcomes] == ["queued"]  # the aborted one's outcome is dropped
    assert s.finish_encoding("encoding") is None and s.num_rows_used == 0 and s.num_live == 0

    s.add(make_input("late", 4, deadline_mono=clock.now + 1), {})
    clock.now += 2
    [expired] = s.expire()
    assert expired.request_id == "late" and isinstance(expired.error, DeadlineExceededError)


def test_fail_plan_fails_every_request() -> None:
    s = make_scheduler()
    s.add(make_input("a", 4, num_image_tokens=2), {"h": b"x"})
    s.add(make_input("b", 4), {})
    s.admit()
    s.finish_encoding("a")
    plan = s.schedule()
    outcomes = s.fail_plan(plan, UnavailableError("boom"))
    assert [o.request_id for o in outcomes] == ["a", "b"] and all(not o.is_ok for o in outcomes)
    assert s.num_live == 0 and s.num_rows_used == 0


def test_plan_round_trips_through_msgpack() -> None:
    s = make_scheduler()
    s.add(make_input("a", 4, num_image_tokens=2), {"h": b"x"})
    s.admit()
    s.finish_encoding("a")
    plan = s.schedule()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=PrefillPlan) == plan


def test_a_mixed_stream_of_image_and_override_requests_never_mixes_and_never_starves() -> None:
    """FCFS across kinds: every plan holds the oldest READY request, so neither kind waits for
    the other to run dry; no plan holds both kinds."""
    s = make_scheduler(num_rows=4096, max_batch_tokens=64)
    kinds = [
        BatchKind.IMAGE,
        BatchKind.EMBEDDING_OVERRIDE,
        BatchKind.EMBEDDING_OVERRIDE,
        BatchKind.TEXT,
    ] * 6
    arrivals = {}
    for i, kind in enumerate(kinds):
        request_id = f"{kind.value}-{i}"
        image_tokens = 2 if kind is BatchKind.IMAGE else 0
        s.add(make_input(request_id, 8, num_image_tokens=image_tokens, kind=kind), {"h": b"x"})
        arrivals[request_id] = i
    for entry in s.admit():
        s.finish_encoding(entry.request_id)
    num_plans, waited = 0, {}
    while s.num_live:
        oldest = min(
            (e for e in s._entries.values() if e.status is PrefillStatus.READY),
            key=lambda e: arrivals[e.request_id],
        )
        plan = s.schedule()
        assert plan is not None and oldest.request_id in plan.request_ids
        kinds_in_plan = {r.request.kind for r in plan.requests}
        assert not {BatchKind.IMAGE, BatchKind.EMBEDDING_OVERRIDE} <= kinds_in_plan, (
            plan.request_ids
        )
        for request_id in plan.request_ids:
            waited[request_id] = num_plans
        s.update_from_output(plan, ok_output(plan))
        num_plans += 1
    assert len(waited) == len(kinds)
    for kind in (BatchKind.IMAGE, BatchKind.EMBEDDING_OVERRIDE):  # each kind keeps getting plans
        plans_of_kind = sorted({waited[r] for r in waited if r.startswith(kind.value)})
        gaps = [b - a for a, b in zip(plans_of_kind, plans_of_kind[1:], strict=False)]
        assert plans_of_kind[0] <= 1 and max(gaps) <= 2
