"""``python -m benchmarks.image_ttft --quick --trace``: the image TTFT benchmark end to end on
the CPU (tiny model): ``stageserve up``, the four rows, the table, the span timeline from the
services' exported spans, and its docs section."""

from __future__ import annotations

import json

import pytest

from benchmarks.image_ttft import SECTION_TITLE, TRACED_STAGES
from benchmarks.system_model import section_title
from tests.conftest import TINY_MODEL_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_quick_run_writes_its_rows_and_keeps_the_other_sections(quick_benchmark) -> None:
    other = "## System (`python -m benchmarks.system`)"
    text = quick_benchmark("benchmarks.image_ttft", SECTION_TITLE, other, "--trace")
    header = next(line for line in text.splitlines() if line.startswith("| row | ok |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    table, timeline = text.split("| row | span |")
    rows = {
        cells[0]: dict(zip(columns, cells, strict=True))
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| row |")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert list(rows) == ["text only", "fresh 320x180", "cached 320x180", "fresh 160x120"]
    for row in rows.values():
        assert row["ok"] == "2/2" and row["TTFT p50 ms"] != "-"
    assert rows["text only"]["encode ms"] == "-" and rows["text only"]["cache misses"] == "0"
    for name in ("fresh 320x180", "fresh 160x120"):  # a new image every request
        row = rows[name]  # the router's prefetch encodes each; prefill's Encode finds it
        assert row["prefetched"] == "2" and row["prefetch ms"] != "-", name
        assert int(row["cache misses"]) + int(row["cache hits"]) == 2, name
        assert row["ViT ms"] != "-"
    cached = rows["cached 320x180"]  # the first left out: all hits, no ViT forward, no prefetch
    assert (cached["cache hits"], cached["cache misses"], cached["ViT ms"]) == ("2", "0", "-")
    assert cached["prefetched"] == "0"
    assert (
        int(cached["prompt tokens"])
        > int(rows["fresh 160x120"]["prompt tokens"])
        > int(rows["text only"]["prompt tokens"])
    )
    spans: dict[str, dict[str, list[str]]] = {}  # row -> span -> [starts at, lasts, requests]
    for line in timeline.splitlines()[1:]:
        if line.startswith("| "):
            row, span, *rest = [c.strip() for c in line.strip("|").split("|")]
            spans.setdefault(row, {})[span] = rest
    assert list(spans) == list(rows)
    for row, by_span in spans.items():
        assert TRACED_STAGES <= set(by_span), row
        assert by_span["router.request"][0] == "0.0" and by_span["router.request"][2] == "2/2"
        assert ("vision_encoder.encode" in by_span) == (row != "text only"), row
    assert float(spans["text only"]["tokenizer.tokenize"][0]) > 0


def test_quick_run_on_a_qwen3_config_writes_a_section_of_its_own(quick_benchmark, tmp_path) -> None:
    """``--config`` a Qwen3-VL config: a random checkpoint of it (the Qwen3 tokenizer, 16-pixel
    patches, DeepStack rows) loaded by every service, its rows under a title naming it."""
    config = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"
    title = section_title(SECTION_TITLE, "Image TTFT", "benchmarks.image_ttft", config)
    flags = ("--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt"))
    text = quick_benchmark("benchmarks.image_ttft", title, SECTION_TITLE, *flags)
    assert "tiny-qwen3-vl dimensions" in text
    rows = [
        line
        for line in text.splitlines()
        if line.startswith(("| text only", "| fresh", "| cached"))
    ]
    assert len(rows) == 4 and all("| 2/2 |" in row for row in rows)
    assert (
        json.loads((tmp_path / "ckpt" / "config.json").read_text())["vision_config"]["patch_size"]
        == 16
    )
