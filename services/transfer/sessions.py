"""Decode's side of a KV handoff: one session per request it awaits, and their single owner.

A session is BOOTSTRAPPING until prefill acknowledges (TRANSFERRING, optional), then ends
SUCCESS (the pages hold the prompt's KV) or FAILED (deadline, abort, failure: ``release``
runs exactly once). The lifecycle across prefill and decode is described in base.py.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from services.common.errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
)

if TYPE_CHECKING:
    from services.transfer.base import KvDestination

Clock = Callable[[], float]  # monotonic seconds; deadlines below are on this clock
ReleaseFn = Callable[[str, tuple[int, ...]], None]  # (request_id, page_ids) -> pages go back


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


class TransferSession:
    """One request's KV handoff on the decode side; FAILED runs ``release`` exactly once."""

    def __init__(
        self,
        request_id: str,
        page_ids: Sequence[int],
        deadline: float,
        release: ReleaseFn,
        clock: Clock = time.monotonic,
        on_terminal: Callable[[TransferSession], None] = lambda session: None,
    ) -> None:
        self.request_id = request_id
        self.page_ids = tuple(page_ids)
        self.deadline = deadline
        self.destination: KvDestination | None = None
        self.error: StageServeError | None = None
        self._release = release
        self._clock = clock
        self._on_terminal = on_terminal
        self._state = TransferState.BOOTSTRAPPING
        self._cond = threading.Condition()

    @property
    def state(self) -> TransferState:
        return self._state

    def mark_transferring(self) -> None:
        """BOOTSTRAPPING -> TRANSFERRING; a no-op once TRANSFERRING or terminal."""
        with self._cond:
            if self._state is TransferState.BOOTSTRAPPING:
                self._state = TransferState.TRANSFERRING

    def mark_done(self) -> None:
        """-> SUCCESS. Completing a finished session raises (``InvalidRequestError``, its error)."""
        with self._cond:
            if self._state is TransferState.SUCCESS:
                raise InvalidRequestError(f"KV transfer for {self.request_id} completed twice")
            if self._state is TransferState.FAILED:
                assert self.error is not None
                raise type(self.error)(
                    f"KV for {self.request_id} arrived after the transfer failed: "
                    f"{self.error.message}"
                )
            self._state = TransferState.SUCCESS
            self._cond.notify_all()
        self._on_terminal(self)

    def mark_failed(self, error: StageServeError) -> bool:
        """-> FAILED and release the pages; False (nothing done) when already terminal."""
        with self._cond:
            if self._state.is_terminal:
                return False
            self._state = TransferState.FAILED
            self.error = error
            self._cond.notify_all()
        self._on_terminal(self)
        self._release(self.request_id, self.page_ids)
        return True

    def abort(self) -> bool:
        return self.mark_failed(AbortedError(f"KV transfer for {self.request_id} aborted"))

    def expire_if_due(self) -> bool:
        if self._clock() < self.deadline:
            return False
        return self.mark_failed(
            DeadlineExceededError(f"KV transfer for {self.request_id} timed out")
        )

    def wait(self, deadline: float) -> TransferState:
        """Block until terminal or ``deadline`` (same clock); past its own deadline -> FAILED."""
        with self._cond:
            while not self._state.is_terminal:
                remaining = min(deadline, self.deadline) - self._clock()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        self.expire_if_due()
        return self._state


class TransferSessionManager:
    """Single owner of in-flight transfer sessions; a session leaves when it turns terminal."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._sessions: dict[str, TransferSession] = {}
        self._lock = threading.Lock()

    @property
    def num_in_flight(self) -> int:
        return len(self._sessions)

    def start(
        self, request_id: str, page_ids: Sequence[int], deadline: float, release: ReleaseFn
    ) -> TransferSession:
        """Open a BOOTSTRAPPING session; ``InvalidRequestError`` if ``request_id`` is in flight."""
        session = TransferSession(request_id, page_ids, deadline, release, self._clock, self._drop)
        with self._lock:
            if request_id in self._sessions:
                raise InvalidRequestError(f"KV transfer for {request_id} is already in flight")
            self._sessions[request_id] = session
        return session

    def get(self, request_id: str) -> TransferSession | None:
        with self._lock:
            return self._sessions.get(request_id)

    def mark_transferring(self, request_id: str) -> None:
        self._in_flight(request_id).mark_transferring()

    def complete(self, request_id: str) -> TransferSession:
        """Mark ``request_id`` SUCCESS; ``InvalidRequestError`` unless in flight (e.g. expired)."""
        session = self._in_flight(request_id)
        session.mark_done()
        return session

    def fail(self, request_id: str, error: StageServeError) -> bool:
        """Mark FAILED and release its pages; False when ``request_id`` is not in flight."""
        session = self.get(request_id)
        return session is not None and session.mark_failed(error)

    def abort(self, request_id: str) -> bool:
        session = self.get(request_id)
        return session is not None and session.abort()

    def abort_all(self) -> int:
        with self._lock:
            sessions = list(self._sessions.values())
        return sum(session.abort() for session in sessions)

    def expire(self) -> list[str]:
        """Fail every session past its deadline (releasing its pages); returns their request ids."""
        with self._lock:
            sessions = list(self._sessions.values())
        return [s.request_id for s in sessions if s.expire_if_due()]

    def _in_flight(self, request_id: str) -> TransferSession:
        session = self.get(request_id)
        if session is None:
            raise InvalidRequestError(
                f"no KV transfer in flight for {request_id} (finished, expired or unknown)"
            )
        return session

    def _drop(self, session: TransferSession) -> None:
        with self._lock:
            if self._sessions.get(session.request_id) is session:
                del self._sessions[session.request_id]
