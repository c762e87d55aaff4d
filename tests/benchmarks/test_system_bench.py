"""``python -m benchmarks.system --quick``: the system benchmark end to end on the CPU (tiny
model): the engine rows, ``stageserve up``, the load at each level, the table and its docs
section."""

from __future__ import annotations

import pytest

from benchmarks.precision import Precision
from benchmarks.system import SECTION_TITLE
from benchmarks.system_model import section_title
from services.engine.quantization import FP8, FP8_E4M3
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


def test_quick_run_of_a_qwen3_config_in_fp8_writes_a_section_of_its_own(
    quick_benchmark, tmp_path
) -> None:
    """``--config`` a Qwen3-VL config with ``--quantization fp8 --kv-cache-dtype fp8_e4m3``: the
    engine bound and the services on a random checkpoint of it, up's prefill and decode running
    with both flags (their command lines, read while they serve), the engine bound's model and
    pool holding e4m3, every request complete, and a section under a title naming the config and
    the precision, the 7B's bf16 one kept."""
    config = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"
    precision = Precision(FP8, FP8_E4M3)
    title = section_title(SECTION_TITLE, "System", "benchmarks.system", config, precision)
    flags = ("--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt"))
    flags += ("--concurrency", "2", *precision.flags())
    text = quick_benchmark("benchmarks.system", title, SECTION_TITLE, *flags)
    lines = text.splitlines()
    assert "tiny-qwen3-vl dimensions, random bf16 weights" in text
    model = next(line for line in lines if line.startswith("- model: "))
    assert "--quantization fp8 --kv-cache-dtype fp8_e4m3" in model  # up's command line
    line = next(line for line in lines if line.startswith("- precision: "))
    assert line.startswith(f"- precision: prefill and decode ran {precision.describe()}")
    assert line.endswith("q/k/v weights float8_e4m3fn, KV pages float8_e4m3fn")
    assert any(line.startswith("| 2 |") and "| 8/8 |" in line for line in lines)
