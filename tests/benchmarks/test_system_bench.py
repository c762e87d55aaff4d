"""``python -m benchmarks.system --quick``: the system benchmark end to end on the CPU (tiny
model): the engine rows, ``stageserve up``, the load at each level, the table and its docs
section."""

from __future__ import annotations

import pytest

from benchmarks.system import SECTION_TITLE
from benchmarks.system_model import section_title
from tests.conftest import TINY_MODEL_DIR

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


def test_quick_run_on_a_qwen3_config_writes_a_section_of_its_own(quick_benchmark, tmp_path) -> None:
    """``--config`` a Qwen3-VL config: the engine bound and the services on a random checkpoint
    of it, its section under a title naming it, the 7B's kept."""
    config = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"
    title = section_title(SECTION_TITLE, "System", "benchmarks.system", config)
    flags = ("--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt"))
    text = quick_benchmark("benchmarks.system", title, SECTION_TITLE, "--concurrency", "2", *flags)
    assert "tiny-qwen3-vl dimensions, random bf16 weights" in text
    assert any(line.startswith("| 2 |") and "| 8/8 |" in line for line in text.splitlines())
