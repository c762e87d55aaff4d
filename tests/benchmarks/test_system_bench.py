"""``python -m benchmarks.system --quick``: the system benchmark end to end on the CPU (tiny model):
the engine rows, ``stageserve up``, the load at each level, the table and its docs section."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.system import SECTION_TITLE
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_quick_run_writes_its_section_and_keeps_the_others(tmp_path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Engine (`python -m benchmarks.engine`)\n\nkept\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.system",
            "--quick",
            "--concurrency",
            "1,2",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    assert "kept" in text and SECTION_TITLE in text
    rows = [
        line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[12] in ("2/2", "4/4")  # every request of the level succeeded
        assert float(cells[9]) <= 1.0  # at most one decode message per step to the one router
