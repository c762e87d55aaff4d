"""On a GPU: a runner given no page count sizes its pool so that what it holds (weights,
activations, CUDA graphs, the pool) is ``gpu_memory_utilization`` of the device, within 2%."""

from __future__ import annotations

import gc

import pytest
import torch

from benchmarks.random_model import CONFIG_7B, build_random_model
from services.engine.cuda_graph import graph_batch_sizes
from services.engine.model_runner import KVCacheConfig, ModelRunner, _profile

pytestmark = pytest.mark.gpu

MAX_BATCH = 256


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
@pytest.mark.parametrize("utilization", [0.5, 0.8])
def test_the_reported_pool_fills_the_share(attention_backend, utilization) -> None:
    model = build_random_model(CONFIG_7B)
    kv = KVCacheConfig(None, 16, utilization, MAX_BATCH)
    runner = ModelRunner(model, kv, attention_backend, graph_batch_sizes(MAX_BATCH))
    size = runner.pool_size
    total = torch.cuda.mem_get_info()[1]
    assert size.utilization == utilization and size.total_bytes == total
    assert runner.kv_pool.num_pages == size.num_pages > 0
    assert runner.kv_pool.k_buffer.nbytes * 2 == size.nbytes
    torch.cuda.reset_peak_memory_stats()
    _profile(runner, MAX_BATCH)  # a step at the largest batch, on the sized pool
    held = torch.cuda.max_memory_reserved()
    assert abs(held / total - utilization) <= 0.02, (held / total, size.describe())
    del runner, model
    gc.collect()
    torch.cuda.empty_cache()
