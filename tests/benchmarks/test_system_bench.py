"""``python -m benchmarks.system --quick``: the system benchmark end to end on the CPU (tiny
model): the engine rows, ``stageserve up``, the load at each level, the table and its docs
section."""

from __future__ import annotations

import pytest

from benchmarks.system import SECTION_TITLE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_quick_run_writes_its_section_and_keeps_the_others(quick_benchmark) -> None:
    other = "## Engine (`python -m benchmarks.engine`)"
    text = quick_benchmark("benchmarks.system", SECTION_TITLE, other, "--concurrency", "1,2")
    rows = [
        line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[12] in ("2/2", "4/4")  # every request of the level succeeded
        assert float(cells[9]) <= 1.0  # at most one decode message per step to the one router
