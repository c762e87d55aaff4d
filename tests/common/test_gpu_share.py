"""The GPU share file: a prefill rank's mark is seen by another process, a decode rank's wait
ends when the mark clears or at its bound, and stale marks, bad slots and bad paths are
handled."""

from __future__ import annotations

import multiprocessing as mp
import time
import types

import pytest

from services.common import gpu_share
from services.common.gpu_share import NUM_SLOTS, STALE_S, GpuShare

WAIT_S = 20.0  # bound on every wait: a hang fails the test instead of stalling it


def _hold_mark(path: str, slot: int, marked, release) -> None:
    share = GpuShare(path)
    with share.marking(slot):
        marked.set()
        release.wait(WAIT_S)
    share.close()


@pytest.fixture
def marker(tmp_path):
    """A process that marks slot 3 of the file until released."""
    ctx = mp.get_context("spawn")
    marked, release = ctx.Event(), ctx.Event()
    path = tmp_path / "share"
    process = ctx.Process(target=_hold_mark, args=(str(path), 3, marked, release))
    process.start()
    assert marked.wait(WAIT_S)
    yield path, release
    release.set()
    process.join(WAIT_S)
    assert process.exitcode == 0


def test_a_mark_in_another_process_holds_a_wait_until_it_clears(marker, monkeypatch) -> None:
    path, release = marker
    share = GpuShare(path)
    assert share.is_prefill_running()
    assert share.wait_for_prefill(0.3) >= 0.3  # held for its whole bound
    polls = []

    def poll(seconds: float) -> None:  # the wait saw the mark: now the prefill rank clears it
        polls.append(seconds)
        release.set()
        time.sleep(seconds)

    clock = types.SimpleNamespace(
        monotonic=time.monotonic, monotonic_ns=time.monotonic_ns, sleep=poll
    )
    with monkeypatch.context() as patch:
        patch.setattr(gpu_share, "time", clock)
        waited = share.wait_for_prefill(WAIT_S)
    assert polls and 0 < waited < WAIT_S  # held by the mark, ended by the clear, not the bound
    deadline_mono = time.monotonic() + WAIT_S
    while share.is_prefill_running() and time.monotonic() < deadline_mono:
        time.sleep(0.01)
    assert not share.is_prefill_running()
    assert share.wait_for_prefill(WAIT_S) == 0.0
    share.close()


def test_marks_clear_on_error_and_a_zero_bound_never_waits(tmp_path) -> None:
    prefill, decode = GpuShare(tmp_path / "s"), GpuShare(tmp_path / "s")
    with pytest.raises(RuntimeError), prefill.marking(0):
        assert decode.is_prefill_running()
        assert decode.wait_for_prefill(0) == 0.0
        raise RuntimeError("the forward failed")
    assert not decode.is_prefill_running()
    prefill.close()
    decode.close()


def test_a_stale_mark_is_ignored(tmp_path) -> None:
    """A prefill rank that died mid-forward leaves its mark: decode stops waiting for it."""
    share = GpuShare(tmp_path / "s")
    share._slots[5] = time.monotonic_ns() - int((STALE_S + 1) * 1e9)
    assert not share.is_prefill_running()
    assert share.wait_for_prefill(WAIT_S) == 0.0
    share._slots[5] = time.monotonic_ns()
    assert share.is_prefill_running()
    share.close()


def test_bad_slots_and_paths_are_clear_errors(tmp_path) -> None:
    share = GpuShare(tmp_path / "s")
    for slot in (-1, NUM_SLOTS):
        with pytest.raises(ValueError, match=f"slot {slot} is not in"), share.marking(slot):
            pass
    share.close()
    missing = tmp_path / "no-such-dir" / "s"
    with pytest.raises(ValueError, match=f"GPU share file {missing}: No such file"):
        GpuShare(missing)
