"""Prefill first on a GPU that prefill and decode share: a small file both map.

Without MPS, the processes on one GPU time-slice it, so a decode step launched while
prefill's forward runs shares the GPU with it, and a closed loop of requests pays for it:
decode steps the requests it has while the prompts queued behind prefill wait, and each of
those steps pays the step's fixed cost (the weights read once) for a batch short of the
waiting prompts. With this file, each prefill rank marks the time it starts a forward in
its slot and clears it when the forward's results are read (``GpuShare.marking``); a
decode rank about to launch a step while a slot is marked waits for it to clear, at most
``max_wait_s`` (``GpuShare.wait_for_prefill``), so a prompt burst runs on the GPU alone
while running requests see at most that much added to one token's latency. It raises the
system's throughput under a prompt burst (``docs/benchmarks.md``, System).
``stageserve up`` sets it when prefill and decode share one CUDA device.

A mark older than ``STALE_S`` is ignored (a prefill rank that died in a forward leaves
one), and a missing or short file is created: the two services start in either order.
Slots are 8-byte aligned int64 (monotonic nanoseconds): x86-64 and arm64 store them whole.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

NUM_SLOTS = 64  # prefill ranks that can mark the file
STALE_S = 10.0  # a mark this old is a rank that died mid-forward (a forward takes < 1 s)
POLL_S = 0.0002  # how often a waiting decode rank looks again


class GpuShare:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = NUM_SLOTS * 8
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"GPU share file {self.path}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: no slot marked
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype=np.int64, count=NUM_SLOTS)

    @contextlib.contextmanager
    def marking(self, slot: int) -> Iterator[None]:
        """Mark ``slot`` (a prefill rank's index) for the duration of one forward."""
        if not 0 <= slot < NUM_SLOTS:
            raise ValueError(f"GPU share slot {slot} is not in [0, {NUM_SLOTS})")
        self._slots[slot] = time.monotonic_ns()
        try:
            yield
        finally:
            self._slots[slot] = 0

    def is_prefill_running(self) -> bool:
        now = time.monotonic_ns()
        marks = self._slots[self._slots > 0]
        return bool(np.any(now - marks < STALE_S * 1e9))

    def wait_for_prefill(self, max_wait_s: float) -> float:
        """Wait while a prefill forward is marked, at most ``max_wait_s``; seconds waited."""
        if max_wait_s <= 0 or not self.is_prefill_running():
            return 0.0
        start = time.monotonic()
        deadline_mono = start + max_wait_s
        while self.is_prefill_running() and time.monotonic() < deadline_mono:
            time.sleep(POLL_S)
        return time.monotonic() - start

    def close(self) -> None:
        del self._slots
        self._map.close()
