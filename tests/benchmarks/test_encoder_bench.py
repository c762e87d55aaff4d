"""``python -m benchmarks.encoder --quick``: both encoders (one and two CPU ranks) run every row,
and the section lands in the report next to the others."""

from __future__ import annotations

import pytest

from benchmarks import encoder

pytestmark = pytest.mark.slow


def test_quick_run_writes_its_section(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks share this machine's cores
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Engine (`python -m benchmarks.engine`)\n\nkept\n")
    assert encoder.main(["--quick", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    text = out.read_text()
    assert "kept" in text and text.count(encoder.SECTION_TITLE) == 1
    rows = [line for line in text.splitlines() if line.startswith("| cpu")]
    assert [r.split(" | ")[0:2] for r in rows] == [
        [f"| {devices}", case]
        for devices in ("cpu", "cpu,cpu")
        for case in ("1 misses", "4 misses", "16 misses", "16, half cached", "1 cached")
    ]
    assert all(float(r.split(" | ")[3]) > 0 for r in rows)  # images/s
