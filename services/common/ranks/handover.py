"""The hand-over of steps from callers' threads to the supervisor thread.

Callers ``submit`` from any thread: the step goes into a queue and a byte into a pipe that
the supervisor polls with its sockets, so a step starts without waiting for a poll
timeout. ``close`` fails whatever is still queued and every later ``submit``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec

Results = list[msgspec.Struct]


@dataclass
class Submitted:
    payload: msgspec.Raw
    timeout_s: float
    future: Future[Results]


class StepHandover:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Submitted] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit and wake against close
        self._closed_error: Exception | None = None
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    def submit(self, payload: msgspec.Raw, timeout_s: float) -> Future[Results]:
        future: Future[Results] = Future()
        with self._lock:
            if self._closed_error is not None:
                future.set_exception(self._closed_error)
                return future
            self._queue.put(Submitted(payload, timeout_s, future))
            self._write_wake()
        return future

    def wake(self) -> None:
        """Make the supervisor's poll return (from any thread)."""
        with self._lock:
            if self._closed_error is None:
                self._write_wake()

    def _write_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: it is awake already
            os.write(self._wake_w, b"\0")

    def clear_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_fd, 4096)

    def is_empty(self) -> bool:
        return self._queue.empty()

    def take(self) -> Submitted | None:
        """The oldest step whose caller still waits (marked running), or None."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return None
            if item.future.set_running_or_notify_cancel():
                return item

    def close(self, error: Exception) -> None:
        """Fail every queued step and every later submit with ``error``; idempotent."""
        with self._lock:
            if self._closed_error is not None:
                return
            self._closed_error = error
            os.close(self.wake_fd)  # under the lock: no submit or wake writes to a closed fd
            os.close(self._wake_w)
        while (item := self.take()) is not None:
            item.future.set_exception(error)
