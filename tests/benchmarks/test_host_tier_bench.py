"""``python -m benchmarks.host_tier --quick``: the host tier's spill and load against
recomputing, on the CPU with the tiny model; its rows and its docs section (the benchmark
itself checks every load bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.host_tier import SECTION_TITLE, main

pytestmark = pytest.mark.slow


def test_quick_run_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert main(["--quick", "--iters", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "kept" in text and SECTION_TITLE in text
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| 256 |") or line.startswith("| 1,024 |")
    ]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and float(cells[4]) > 0
        assert cells[6].endswith("x") and float(cells[6][:-1]) > 0
        # the spill's hold on the step's stream, its copy's end, a spill then a forward
        assert all(float(c) > 0 for c in cells[7:10]) and len(cells) == 10
    assert "not measured in this run" in text  # no 32k row in the quick run
