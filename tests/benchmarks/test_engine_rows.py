"""The engine benchmark's decode loop is the decode rank's (StepLoop over DecodeBatchRunner):
on the tiny model on CPU, overlapped and synchronous, it reads the tokens a plain loop makes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine_rows import _decode_steps, decode_loop
from services.engine.attention import ForwardMode
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
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
