"""``benchmarks.host_tier``'s L3 measurement (``--kv-store``) on the CPU with the tiny model,
against a real ``mooncake_master`` and store clients: every fetched page is checked bit for bit
against what the forward wrote, and one bit off in a fetched page fails the run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from benchmarks.host_tier import PAGE_SIZE, main
from benchmarks.host_tier_store import measure_store
from services.common.paths import BUNDLED_MODEL
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.prefill.kv_store import PageLayout
from services.prefill.store_tier import StoreWriter
from tests.conftest import needs_mooncake

pytestmark = [needs_mooncake, pytest.mark.slow]

NUM_FULL = 3
NUM_TOKENS = NUM_FULL * PAGE_SIZE + 5  # the partial last page is not stored
NUM_PAGES = 16


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    model = load_model(str(BUNDLED_MODEL), device="cpu", components=("language",))
    return ModelRunner(
        model, KVCacheConfig(NUM_PAGES, PAGE_SIZE), "torch", cuda_graph_batch_sizes=()
    )


def test_every_fetched_page_is_checked_and_handed_back(runner: ModelRunner) -> None:
    m = measure_store(runner, NUM_TOKENS, iters=1)
    assert m["checked_pages"] == 2 * NUM_FULL  # the warm-up round and the timed one
    assert m["bytes"] == NUM_FULL * PageLayout.of(runner.kv_pool).value_nbytes
    assert m["put_ms"] > 0 and m["fetch_ms"] > 0
    assert runner.page_table.manager.num_free_pages == NUM_PAGES


@pytest.mark.parametrize("which", ["K", "V"])
def test_one_bit_off_in_a_fetched_page_fails_the_run(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    get = StoreWriter.get

    def corrupted(self: StoreWriter, keys: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        kv = get(self, keys)
        # [layers, pages, page_size, heads, dim]: the lowest bit of one value of the last page
        kv["KV".index(which)][0, -1, 0, 0].view(torch.uint8)[0] ^= 1
        return kv

    monkeypatch.setattr(StoreWriter, "get", corrupted)
    with pytest.raises(AssertionError, match=f"the KV store changed {which}"):
        measure_store(runner, NUM_TOKENS, iters=1)
    assert runner.page_table.manager.num_free_pages == NUM_PAGES


def test_quick_run_puts_the_l3_row_beside_the_l2_row(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    assert main(["--quick", "--kv-store", "--tokens", "64", "--iters", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 64 |")]
    l2, l3 = ([c.strip() for c in row.strip("|").split("|")] for row in rows)
    assert (l2[1], l3[1]) == ("L2 host", "L3 store")
    assert l3[2:4] == l2[2:4]  # the same pages, the same recompute
    # write, write GB/s, fetch, fetch ms per MB, fetch GB/s; no spill stream columns
    assert all(float(l3[i]) > 0 for i in range(4, 9)) and l3[10:] == ["-"] * 3
    assert "- KV store: mooncake" in text and "L3 store rows (`--kv-store`)" in text
