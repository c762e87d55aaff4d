"""``python -m benchmarks.moe_layer --quick``: the MoE layer's rows against its roofline on the
CPU with tiny dims, and its docs section; the roofline's byte and FLOP counts at the 30B-A3B
dims; the target's verdict (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.moe_layer import (
    HIDDEN_30B,
    MOE_30B,
    SECTION_TITLE,
    expert_bytes,
    expert_flops,
    main,
)
from benchmarks.moe_layer_table import HEADER, Measurement, verdict
from services.engine.model.moe import SparseMoE


def test_quick_run_writes_its_rows_and_section(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "kept" in text and text.count(SECTION_TITLE) == 1
    assert "| " + " | ".join(HEADER) + " |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 16 |"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(HEADER)
        assert cells[1] == "grouped"  # the CPU's forward (no Triton)
        assert 1 <= float(cells[2]) <= 8  # experts hit, of 8
        assert float(cells[4]) > 0 and cells[5] == "-"  # eager; no CUDA graph on the CPU
        assert float(cells[6]) > 0 and cells[7] in ("memory", "compute")
        assert cells[8].endswith("%")
    assert "not measured in this run" in text  # no 256 or 8k row in the quick run


def test_quick_run_without_out_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--quick", "--tokens", "3", "--iters", "1"]) == 0
    assert not list(tmp_path.iterdir())


def test_roofline_counts_at_the_30b_dims() -> None:
    with torch.device("meta"):
        layer = SparseMoE(HIDDEN_30B, MOE_30B, "silu").to(torch.bfloat16)
    assert expert_bytes(layer) == 3 * 2048 * 768 * 2  # gate, up and down, bf16
    assert expert_flops(256, HIDDEN_30B, MOE_30B) == 2 * 256 * 8 * 3 * 2048 * 768


def _measured(num_tokens: int, efficiency: float, forward: str = "triton") -> Measurement:
    return Measurement(num_tokens, forward, 128, 1e9, 2.0, 1.0, efficiency, "memory")


TRITON_LAYER = SimpleNamespace(forward_kind=lambda num_tokens: "triton")


def test_verdict_needs_both_target_rows_of_the_engines_forward_at_70_percent() -> None:
    assert verdict([_measured(256, 0.8), _measured(8192, 0.75)], TRITON_LAYER).endswith(
        ": met (triton forward: 256: 80%, 8,192: 75%)"
    )
    assert ": not met (triton forward: 256: 80%, 8,192: 50%)" in verdict(
        [_measured(256, 0.8), _measured(8192, 0.5)], TRITON_LAYER
    )
    assert verdict([_measured(64, 0.1), _measured(256, 0.9)], TRITON_LAYER).endswith(
        ": met (triton forward: 256: 90%); 8,192 not measured"
    )
    other = [_measured(256, 0.9, "grouped"), _measured(8192, 0.9, "grouped")]
    assert verdict([_measured(256, 0.5), _measured(8192, 0.5), *other], TRITON_LAYER).endswith(
        ": not met (triton forward: 256: 50%, 8,192: 50%)"
    ), "another forward's rows do not count"
