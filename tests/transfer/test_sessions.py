import threading
import time

import pytest
import torch

from services.common.errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidRequestError,
    UnavailableError,
)
from services.engine.kv_cache import KVPageManager, KVPool, RequestPageTable
from services.transfer import TransferSessionManager, TransferState, create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Releases:
    def __init__(self, manager: KVPageManager | None = None) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.manager = manager

    def __call__(self, request_id: str, page_ids: tuple[int, ...]) -> None:
        self.calls.append((request_id, page_ids))
        if self.manager is not None:
            self.manager.free(list(page_ids))


def test_success_path_keeps_pages_and_leaves_the_manager() -> None:
    sessions, release = TransferSessionManager(FakeClock()), Releases()
    session = sessions.start("req-1", [4, 5], deadline=110.0, release=release)
    assert session.state is TransferState.BOOTSTRAPPING and sessions.num_in_flight == 1
    sessions.mark_transferring("req-1")
    assert session.state is TransferState.TRANSFERRING
    assert sessions.complete("req-1") is session
    assert session.state is TransferState.SUCCESS and sessions.num_in_flight == 0
    assert release.calls == []  # the pages now belong to the running request
    assert session.wait(deadline=0.0) is TransferState.SUCCESS


def test_double_completion_is_an_error() -> None:
    sessions = TransferSessionManager(FakeClock())
    session = sessions.start("req-1", [1], deadline=110.0, release=Releases())
    sessions.complete("req-1")
    with pytest.raises(InvalidRequestError, match="no KV transfer in flight"):
        sessions.complete("req-1")
    with pytest.raises(InvalidRequestError, match="completed twice"):
        session.mark_done()
    assert not session.abort()  # abort after success changes nothing


def test_duplicate_start_is_rejected() -> None:
    sessions = TransferSessionManager(FakeClock())
    sessions.start("req-1", [1], deadline=110.0, release=Releases())
    with pytest.raises(InvalidRequestError, match="already in flight"):
        sessions.start("req-1", [2], deadline=110.0, release=Releases())


def test_deadline_sweep_fails_and_releases_exactly_once() -> None:
    clock, release = FakeClock(), Releases()
    sessions = TransferSessionManager(clock)
    late = sessions.start("late", [1, 2], deadline=105.0, release=release)
    sessions.start("fine", [3], deadline=120.0, release=release)
    assert sessions.expire() == []
    clock.now = 105.0
    assert sessions.expire() == ["late"]
    assert late.state is TransferState.FAILED and isinstance(late.error, DeadlineExceededError)
    assert release.calls == [("late", (1, 2))]
    assert (
        sessions.expire() == [] and not late.abort() and not late.mark_failed(UnavailableError("x"))
    )
    assert release.calls == [("late", (1, 2))] and sessions.num_in_flight == 1
    with pytest.raises(DeadlineExceededError, match="arrived after the transfer failed"):
        late.mark_done()  # prefill's "KV ready" after decode gave up


def test_abort_fails_releases_once_and_wakes_waiters() -> None:
    release = Releases()
    sessions = TransferSessionManager()
    session = sessions.start("req-1", [7], deadline=time.monotonic() + 30, release=release)
    states: list[TransferState] = []
    waiter = threading.Thread(target=lambda: states.append(session.wait(time.monotonic() + 30)))
    waiter.start()
    assert sessions.abort("req-1")
    waiter.join(timeout=5)
    assert states == [TransferState.FAILED] and isinstance(session.error, AbortedError)
    assert not sessions.abort("req-1") and release.calls == [("req-1", (7,))]


def test_wait_returns_in_flight_at_callers_deadline_and_fails_at_sessions() -> None:
    release = Releases()
    session = TransferSessionManager().start(
        "req-1", [0], deadline=time.monotonic() + 0.2, release=release
    )
    assert session.wait(time.monotonic() + 0.01) is TransferState.BOOTSTRAPPING
    assert session.wait(time.monotonic() + 30) is TransferState.FAILED
    assert release.calls == [("req-1", (0,))]


def test_no_page_is_lost_across_success_expiry_abort_and_close() -> None:
    clock = FakeClock()
    manager = KVPageManager(num_pages=32, page_size=4)
    table = RequestPageTable(manager)
    pool = KVPool(2, 32, 4, 1, 4, torch.float32, "cpu")
    receiver = create_kv_receiver("inprocess", fabric=InProcessFabric(), clock=clock)
    receiver.register(pool)
    release_calls: list[str] = []

    def release(request_id: str, page_ids: tuple[int, ...]) -> None:
        assert tuple(table.pages(request_id)) == page_ids
        release_calls.append(request_id)
        table.release(request_id)

    for i in range(8):
        request_id = f"req-{i}"
        pages = table.reserve(request_id, total_len=10)  # 3 pages each
        session = receiver.open_session(request_id, pages, deadline=100.0 + i, release=release)
        assert session.destination is not None and session.destination.page_ids == tuple(pages)
    assert manager.num_free_pages == 32 - 8 * 3
    receiver.sessions.complete("req-0")
    receiver.sessions.complete("req-5")
    receiver.sessions.abort("req-6")
    clock.now = 103.0  # req-1..req-3 expire; req-4 and req-7 stay in flight
    assert receiver.sessions.expire() == ["req-1", "req-2", "req-3"]
    receiver.close()  # aborts req-4 and req-7
    assert sorted(release_calls) == ["req-1", "req-2", "req-3", "req-4", "req-6", "req-7"]
    assert receiver.sessions.num_in_flight == 0
    assert len(table) == 2 and "req-0" in table and "req-5" in table  # only successes hold pages
    table.release("req-0")
    table.release("req-5")
    assert manager.num_free_pages == 32
