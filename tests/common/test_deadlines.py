"""``deadline_mono``: one wall-clock wire deadline, the RPC's and a cap become one monotonic
deadline. A fake monotonic clock at 1000 s; wall-clock margins are generous (minutes)."""

from __future__ import annotations

import math
import time

import pytest

from services.common.deadlines import deadline_mono, mono_of_unix_s

MONO_NOW = 1000.0


def clock() -> float:
    return MONO_NOW


def unix_ms_in(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)


def mono(deadline_unix_ms: int, grpc_s: float | None, default_s: float, **kw: object) -> float:
    return deadline_mono(deadline_unix_ms, grpc_s, default_s, clock=clock, **kw) - MONO_NOW


def test_without_either_deadline_the_default_counts_from_now() -> None:
    assert mono(0, None, 30.0) == 30.0
    assert deadline_mono(0, None, math.inf) == math.inf


def test_the_earlier_of_the_wire_and_the_grpc_deadline_wins() -> None:
    assert mono(unix_ms_in(600), 60.0, 30.0) == 60.0
    assert mono(unix_ms_in(60), 600.0, 30.0) == pytest.approx(60.0, abs=5.0)
    assert mono(unix_ms_in(60), None, 30.0) == pytest.approx(60.0, abs=5.0)
    assert mono(0, 60.0, 30.0) == 60.0


def test_the_cap_bounds_every_deadline_and_the_default() -> None:
    cap = unix_ms_in(120)
    assert mono(0, None, math.inf, cap_unix_ms=cap) == pytest.approx(120.0, abs=5.0)
    assert mono(unix_ms_in(600), 900.0, 30.0, cap_unix_ms=cap) == pytest.approx(120.0, abs=5.0)
    assert mono(0, 60.0, 30.0, cap_unix_ms=cap) == 60.0


def test_a_passed_wire_deadline_is_already_behind_now() -> None:
    assert mono(unix_ms_in(-60), None, 30.0) < 0


def test_a_unix_deadline_moves_to_the_monotonic_clock() -> None:
    assert mono_of_unix_s(time.time() + 60, clock) - MONO_NOW == pytest.approx(60.0, abs=5.0)
