"""``python -m benchmarks.prefix_cache --quick``: the prefix cache benchmark end to end on the CPU
(tiny model): two ``stageserve up`` systems, the cache on then off, every row through the serving
client, prefill's cache counters, the table, the targets and its docs section."""

from __future__ import annotations

import pytest

from benchmarks.prefix_cache import SECTION_TITLE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUNS = ("shared prefix", "multi-turn", "new tokens only", "image multi-turn")
TURNS = ("multi-turn", "image multi-turn")


def _table(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """(row, cache) -> column -> cell of the section's table."""
    section = text.split(SECTION_TITLE, 1)[1]
    header = next(line for line in section.splitlines() if line.startswith("| row | cache |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    table = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| row |"):
            cells = dict(zip(columns, [c.strip() for c in line.strip("|").split("|")], strict=True))
            table[cells["row"], cells["cache"]] = cells
    return table


def test_quick_run_writes_cache_on_and_off_rows(quick_benchmark) -> None:
    other = "## Image TTFT (`python -m benchmarks.image_ttft`)"
    # the smallest load that still has hits and misses in every row (the suite's time)
    small = ("--num-requests", "4", "--num-warmups", "1", "--concurrency", "2")
    text = quick_benchmark("benchmarks.prefix_cache", SECTION_TITLE, other, *small)
    table = _table(text)
    names = list(RUNS[:3]) + [n + s for n in TURNS for s in (": turn 1", ": turns >= 2")]
    names += [RUNS[3]]
    assert set(table) == {(name, cache) for name in names for cache in ("on", "off")}
    assert [key[0] for key in table][:2] == ["shared prefix", "shared prefix"]  # on, then off
    for (name, cache), row in table.items():
        done, planned = row["ok"].split("/")
        assert done == planned and int(planned) > 0, (name, cache)
        assert row["TTFT p50 ms"] != "-" and row["TTFT p90 ms"] != "-", (name, cache)
        if name in RUNS:
            assert row["req/s"] != "-" and row["out tok/s"] != "-", (name, cache)
            # on: "req/s on/off" is the on line's over the off line's
            assert (row["req/s on/off"] != "-") == (cache == "on"), (name, cache)
        else:  # a turn's share of a multi-turn run: TTFT only
            assert row["req/s"] == "-" and row["hit tokens"] == "-", (name, cache)
    for name in ("shared prefix", *TURNS):  # the cache on reads pages; off, it is never asked
        on, off = table[name, "on"], table[name, "off"]
        assert 0 < int(on["hit tokens"]) < int(on["queried tokens"]), name
        assert 0 < float(on["hit rate"]) < 1, name
        assert (off["hit tokens"], off["queried tokens"], off["hit rate"]) == ("0", "0", "-"), name
    assert table["new tokens only", "off"]["hit tokens"] == "0"
    for name in TURNS:  # a later turn holds turn 1 and its reply: a longer prompt
        first = int(table[name + ": turn 1", "on"]["prompt tokens"])
        assert int(table[name + ": turns >= 2", "on"]["prompt tokens"]) > first, name
    targets = [line for line in text.splitlines() if line.startswith("- ") and "**" in line]
    assert len(targets) == 3, targets  # shared prefix, and a later turn of each multi-turn
    assert all(line.endswith(("**met**.", "**not met**.")) for line in targets), targets
    assert "- L2 hit" in text
