"""ViT CUDA graphs (services/engine/vision_graph.py): the flag reaches the rank worker and is
checked (CPU); on a GPU (device tool, never in CI) a layout runs eagerly once, is captured the
second time, and every replay's rows equal the eager forward's on the same pixels exactly,
through an LRU that evicts the least recently used layout and recaptures it when it returns."""

from __future__ import annotations

import pytest
import torch

from services.engine.vision_graph import VisionGraphs
from tests.conftest import TINY_MODEL_DIR


def test_the_graphs_flag_reaches_the_rank_init_and_is_checked() -> None:
    from services.vision_encoder.__main__ import parse_args
    from services.vision_encoder.app import rank_init

    assert rank_init(parse_args([]), 0).vit_cuda_graphs == 8
    assert rank_init(parse_args(["--vit-cuda-graphs", "0"]), 0).vit_cuda_graphs == 0
    with pytest.raises(SystemExit):
        parse_args(["--vit-cuda-graphs", "-1"])


def test_a_cpu_rank_runs_the_vit_eagerly(vision_model, image_processor) -> None:
    from services.transfer.embeddings_inprocess import EmbeddingFabric, InProcessEmbeddingSender
    from services.vision_encoder.cache import EmbeddingCacheManager
    from services.vision_encoder.worker import EncoderWorker

    sender = InProcessEmbeddingSender(EmbeddingFabric())
    cache = EmbeddingCacheManager(1 << 20)
    worker = EncoderWorker(0, vision_model, image_processor, cache, sender, 1 << 20, "pil", 8)
    assert worker.vit_graphs is None
    with pytest.raises(AssertionError, match="CUDA"):
        VisionGraphs(vision_model.visual, 8)


def _pixels(model, grids, seed: int) -> torch.Tensor:
    v = model.config.vision
    num_patches = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(seed)
    dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    return torch.randn(num_patches, dim, generator=generator).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_rows_equal_the_eager_rows(dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from services.engine.loader import load_model

    model = load_model(TINY_MODEL_DIR, torch.device("cuda:0"), dtype, components=("vision",))
    graphs = VisionGraphs(model.visual, max_graphs=2)
    one = [(1, 16, 22)]
    two = [(1, 8, 8), (1, 34, 46)]  # two images of different sizes: windows of several lengths
    three = [(1, 12, 20)]
    calls = [one, one, one, two, two, one, three, three, two, two]  # `two` is evicted by `three`
    with torch.inference_mode():
        for i, grids in enumerate(calls):
            pixels = _pixels(model, grids, seed=i)
            rows = graphs.forward(pixels, grids)
            assert torch.equal(rows, model.visual(pixels, grids)), (i, grids)
    # captures: one (2nd call), two (5th), three (8th, evicting two), two again at once (9th,
    # evicting one); every other call from the 2nd replays
    assert graphs.num_captures == 4
    assert graphs.num_replays == 7  # calls 2, 3, 5, 6, 8, 9, 10
    assert graphs.num_graphs == 2
