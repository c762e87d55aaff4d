"""The rank's preprocessing seam: the PIL and torch methods give the same layout and grids,
pixels within one uint8 level, and ViT rows (tiny checkpoint, float32) within a stated
tolerance; the torch method on cuda:0 (``gpu``) agrees with it on the CPU and with PIL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine import ops
from services.vision_encoder.pixels import PixelMethod, prepare_pixels, resolve_method
from tests.conftest import make_image

# One uint8 level of the normalized values: 1 / 255 / min(image_std) = 0.0150.
ONE_LEVEL = 0.01502
# Measured on the tiny checkpoint (float32, CPU): max |rows(torch) - rows(PIL)| 4.3e-3
# (the rows reach 2.45).
VIT_ATOL = 1e-2
# The step's images: two of one size (one batched call), the rest per size, in this order.
SIZES = [(1920, 1080), (640, 480), (56, 56), (300, 97), (640, 480), (1000, 40), (30, 10)]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def images():  # decoded pixels, as the rank's worker has them
    return [np.asarray(make_image(w, h, seed=50 + i)) for i, (w, h) in enumerate(SIZES)]


def test_auto_is_torch_on_cuda_and_pil_elsewhere() -> None:
    assert resolve_method("auto", torch.device("cuda:0")) is PixelMethod.TORCH
    assert resolve_method("auto", CPU) is PixelMethod.PIL
    assert resolve_method("torch", CPU) is PixelMethod.TORCH
    assert resolve_method("pil", torch.device("cuda:1")) is PixelMethod.PIL


def test_torch_method_keeps_the_layout_and_the_order(image_processor, images) -> None:
    exact = prepare_pixels(image_processor, images, CPU, PixelMethod.PIL)
    ours = prepare_pixels(image_processor, images, CPU, PixelMethod.TORCH)
    assert ours.shape == exact.shape and ours.dtype == exact.dtype == torch.float32
    assert (ours - exact).abs().max().item() <= ONE_LEVEL
    singles = [prepare_pixels(image_processor, [i], CPU, PixelMethod.TORCH) for i in images]
    assert torch.equal(ours, torch.cat(singles))  # grouped by size, put back in order


def vit_rows(model, processor, images, device, method) -> torch.Tensor:
    grids = [processor.grid_for_size(*image.shape[:2]) for image in images]
    with torch.inference_mode(), ops.on_device(device):
        pixels = prepare_pixels(processor, images, device, method)
        return model.encode_images(pixels, grids).float().cpu()


def test_vit_rows_of_both_methods_agree(vision_model, image_processor, images) -> None:
    exact = vit_rows(vision_model, image_processor, images, CPU, PixelMethod.PIL)
    ours = vit_rows(vision_model, image_processor, images, CPU, PixelMethod.TORCH)
    assert ours.shape == exact.shape
    assert (ours - exact).abs().max().item() <= VIT_ATOL


@pytest.mark.gpu
def test_torch_method_on_cuda_matches_cpu_and_pil(image_processor, images) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cuda = torch.device("cuda:0")
    on_gpu = prepare_pixels(image_processor, images, cuda, PixelMethod.TORCH).cpu()
    on_cpu = prepare_pixels(image_processor, images, CPU, PixelMethod.TORCH)
    exact = prepare_pixels(image_processor, images, CPU, PixelMethod.PIL)
    assert on_gpu.shape == exact.shape
    for reference in (on_cpu, exact):
        diff = (on_gpu - reference).abs()
        assert diff.max().item() <= ONE_LEVEL
        assert (diff > 1e-6).float().mean().item() <= 0.005


def test_the_pixel_method_flag_reaches_the_rank_worker(vision_model, image_processor) -> None:
    from services.transfer.embeddings_inprocess import EmbeddingFabric, InProcessEmbeddingSender
    from services.vision_encoder.__main__ import parse_args
    from services.vision_encoder.app import rank_init
    from services.vision_encoder.cache import EmbeddingCacheManager
    from services.vision_encoder.worker import EncoderWorker

    assert parse_args([]).pixel_method == "auto"
    init = rank_init(parse_args(["--pixel-method", "torch"]), 0)
    assert init.pixel_method == "torch"
    sender = InProcessEmbeddingSender(EmbeddingFabric())
    cache = EmbeddingCacheManager(1 << 20)
    worker = EncoderWorker(
        0, vision_model, image_processor, cache, sender, 1 << 20, init.pixel_method
    )
    assert worker.pixel_method is PixelMethod.TORCH  # on a CPU rank, where auto is PIL
    with pytest.raises(SystemExit):
        parse_args(["--pixel-method", "numpy"])
