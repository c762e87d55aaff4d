"""The engine benchmark's decode loop is the decode rank's (StepLoop over DecodeBatchRunner):
on the tiny model on CPU, overlapped and synchronous, it reads the tokens a plain loop makes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine_rows import _decode_steps, decode_loop, make_runner
from services.engine.attention import ForwardMode
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.quantization import AUTO_KV_CACHE_DTYPE, FP8_E4M3
from tests.conftest import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    runner = ModelRunner(
        load_model(TINY_MODEL_DIR, components=("language",)), KVCacheConfig(64, 16)
    )
    for i in range(3):
        runner.page_table.reserve(f"r{i}", 33)
    return runner


def plain_loop(runner: ModelRunner, steps, num_steps: int) -> list[list[int]]:
    tokens, out = torch.tensor([s.input_ids[0] for s in steps]), []
    for _ in range(num_steps):
        tokens = runner.forward(ForwardMode.DECODE, steps, input_ids=tokens).argmax(-1)
        out.append(tokens.tolist())
    return out


@pytest.mark.parametrize("is_overlapped", [True, False])
def test_decode_loop_reads_the_tokens_of_a_plain_loop(runner, is_overlapped) -> None:
    steps = _decode_steps([f"r{i}" for i in range(3)], 32)
    expected = plain_loop(runner, steps, 6)
    assert decode_loop(runner, steps, 6, is_overlapped=is_overlapped) == expected
    assert len({tuple(t) for t in expected}) > 1  # the samples feed back: the steps differ


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"),
    [(AUTO_KV_CACHE_DTYPE, torch.float32), (FP8_E4M3, torch.float8_e4m3fn)],
)
def test_the_benchmark_runners_pool_holds_normal_values_in_its_dtype(kv_cache_dtype, dtype):
    """Attention is never timed over zeros, FP8 pages included (torch draws no e4m3 normals)."""
    model = load_model(TINY_MODEL_DIR, components=("language",))
    runner = make_runner(model, 64, "torch", max_batch=1, kv_cache_dtype=kv_cache_dtype)
    for buffer in (runner.kv_pool.k_buffer, runner.kv_pool.v_buffer):
        assert buffer.dtype == dtype
        values = buffer.float()
        assert values.isfinite().all() and 0.9 < values.std().item() < 1.1
