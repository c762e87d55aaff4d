"""``python -m benchmarks.system --quick``: the system benchmark end to end on the CPU (tiny
model): the engine rows, ``stageserve up``, the load at each level, the table and its docs
section."""

from __future__ import annotations

import pytest

from benchmarks.system import SECTION_TITLE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_quick_run_writes_its_section_and_keeps_the_others(quick_benchmark) -> None:
    other = "## Engine (`python -m benchmarks.engine`)"
    # prefill first, as on a GPU by default (the share file on the CPU)
    flags = ("--concurrency", "1,2", "--prefill-first-ms", "20")
    text = quick_benchmark("benchmarks.system", SECTION_TITLE, other, *flags)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| concurrency |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
        assert cells["ok"] in ("4/4", "8/8")  # every request of the level succeeded
        # --quick's 64 prompt tokens as the server counted them, the chat template's included
        assert cells["mean prompt tokens"] == "64"
        # at most one decode message per step to the one router
        assert float(cells["msgs/step"]) <= 1.0
        assert 0.0 < float(cells["prefill busy"]) < 1.0  # the prompts' forwards were counted
        assert 0.0 <= float(cells["decode held"]) < 1.0 and int(cells["decode steps"]) > 0
