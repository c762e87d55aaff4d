"""The vision tower against transformers' on the bundled checkpoint (fp32, CPU), for grids the
processor does not produce today: several frames (t > 1), odd window remainders, several images."""

from __future__ import annotations

import pytest
import torch

from services.engine.model.vision import Segments, segment_attention


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 8, 12)],  # one image: the full-attention blocks see one segment (no gather)
        [(2, 6, 10), (1, 4, 4)],  # two frames of one input, then an image: full attention per frame
        [(3, 4, 6), (1, 10, 6), (1, 2, 2)],
    ],
)
def test_vision_embeddings_match_transformers(pipeline, hf_model, grids):
    model = pipeline.engine.runner.model
    v = model.config.vision
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    generator = torch.Generator().manual_seed(len(grids))
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=generator)
    with torch.inference_mode():
        ours = model.encode_images(pixels, grids)
        theirs = hf_model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert (
        ours.shape
        == theirs.shape
        == (pixels.shape[0] // v.spatial_merge_size**2, model.config.text.hidden_size)
    )
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_segments_attend_only_within_each_segment():
    torch.manual_seed(0)
    cu = [
        0,
        3,
        7,
        10,
        10,
        14,
    ]  # lengths 3, 4, 3, 0, 4: two groups gathered, an empty segment skipped
    q, k, v = (torch.randn(14, 2, 8) for _ in range(3))
    out = segment_attention(q, k, v, Segments(cu, torch.device("cpu")))
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b > a:
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (q, k, v))
            )
            torch.testing.assert_close(out[a:b], ref.transpose(0, 1))
    tiled = Segments([0, 5, 10, 15], torch.device("cpu"))
    assert tiled.tiled_length == 5 and not tiled.groups
    q, k, v = (torch.randn(15, 2, 8) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(3, 5, 2, 8).transpose(1, 2) for t in (q, k, v))
    )
    torch.testing.assert_close(
        segment_attention(q, k, v, tiled), ref.transpose(1, 2).reshape(15, 2, 8)
    )


@pytest.mark.gpu
def test_segments_on_cuda_run_one_varlen_call_within_bf16_of_per_segment_sdpa():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    cu = [0, 64, 128, 176, 192, 192, 204]  # window lengths of a 1080p image, and an empty one
    assert Segments(cu, torch.device("cuda")).cu is None  # per-length SDPA unless asked
    segments = Segments(cu, torch.device("cuda"), varlen=True)
    assert segments.cu.tolist() == [0, 64, 128, 176, 192, 204] and segments.max_length == 64
    q, k, v = (torch.randn(204, 16, 80, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = segment_attention(q, k, v, segments)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b > a:
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t[a:b].float().transpose(0, 1) for t in (q, k, v))
            ).transpose(0, 1)
            torch.testing.assert_close(out[a:b].float(), ref, atol=2e-2, rtol=2e-2)
