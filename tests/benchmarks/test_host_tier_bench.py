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
    rows = [line for line in text.splitlines() if line.startswith(("| 256 |", "| 1,024 |"))]
    assert len(rows) == 2  # no L3 rows without --kv-store
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "L2 host" and len(cells) == 13
        # KV MB, recompute, write (spill), fetch (load) ms, fetch ms per MB
        assert all(float(cells[i]) > 0 for i in (2, 3, 4, 6, 7))
        assert cells[9].endswith("x") and float(cells[9][:-1]) > 0
        # the spill's hold on the step's stream, its copy's end, a spill then a forward
        assert all(float(c) > 0 for c in cells[10:13])
    assert "not measured in this run" in text  # no 32k row in the quick run
    assert "KV store" not in text
