"""The MoE layer's Triton forward on a GPU: equal to the reference forward in each dtype, under
every tile shape the engine picks or the benchmark sweeps, with expert parallelism's partial
outputs, on skewed routings, and captured in a CUDA graph (no host reads) replaying new inputs."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from benchmarks.moe_layer import SWEEP
from services.engine.model.moe import route
from tests.engine.test_expert_parallel import rank_layer
from tests.engine.test_moe import NUM_EXPERTS, TOP_K, inputs, random_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
triton_moe = pytest.importorskip("services.engine.triton_moe", reason="needs Triton")

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
TILES = sorted(
    {config for _, config in triton_moe._CONFIGS} | {triton_moe.TileConfig(*s) for s in SWEEP},
    key=repr,
)


def cuda_layer(dtype: torch.dtype, **kwargs):
    layer = random_layer(fused=False, **kwargs).to("cuda", dtype)
    layer.fuse_projections()
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 64, 700])
def test_triton_forward_matches_the_reference(dtype, num_tokens):
    layer = cuda_layer(dtype)
    assert layer.kernels is triton_moe and not layer.syncs_host, "every dtype captures"
    x = inputs(num_tokens).to("cuda", dtype)
    with torch.no_grad():
        weights, experts = route(layer.gate(x), TOP_K, True)
        ours = layer(x)
        reference = layer.reference_forward(x, weights, experts)
    assert ours.shape == x.shape and ours.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours, reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("routing", ["tied", "one hot expert", "few tokens"])
def test_skewed_routings_match_the_reference(routing):
    """Ties between two experts' logits, every token on one expert (one expert's pairs span
    many blocks), and experts no token picks (empty runs: no block)."""
    layer = cuda_layer(torch.bfloat16)
    with torch.no_grad():
        if routing == "tied":
            layer.gate.weight[4] = layer.gate.weight[1]
        elif routing == "one hot expert":
            layer.gate.weight[0] = layer.gate.weight.abs().sum(0)
    x = inputs(3 if routing == "few tokens" else 200, seed=4).to("cuda", torch.bfloat16)
    with torch.no_grad():
        weights, experts = route(layer.gate(x), TOP_K, True)
        if routing == "few tokens":
            assert experts.unique().numel() < NUM_EXPERTS
        ours = layer(x)
        reference = layer.reference_forward(x, weights, experts)
    torch.testing.assert_close(ours, reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tile", TILES, ids=repr)
def test_every_tile_shape_gives_the_same_output(tile):
    layer = cuda_layer(torch.float32, inter=40)  # I' padded to 64: a partial N tile at 128
    x = inputs(300, seed=3).to("cuda")
    with torch.no_grad():
        reference = layer.reference_forward(x, *route(layer.gate(x), TOP_K, True))
        with mock.patch.object(triton_moe, "tile_config", lambda _pairs: tile):
            ours = layer(x)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("routing", ["random", "one expert"])
def test_expert_parallel_parts_sum_to_the_whole_layer(size, routing):
    full = cuda_layer(torch.float32)
    x = inputs(40).to("cuda")
    with torch.no_grad():
        weights, experts = route(full.gate(x), TOP_K, True)
        if routing == "one expert":
            experts = torch.tensor([[1, 4]], device="cuda").expand_as(experts).contiguous()
        whole = full.reference_forward(x, weights, experts)
        total = torch.zeros_like(x)
        for rank in range(size):
            layer = rank_layer(full, rank, size)
            assert layer.kernels is triton_moe
            assert layer.experts.down_proj.shape[0] == NUM_EXPERTS // size
            total += layer.pairs_forward(x, weights, experts, "triton")
    torch.testing.assert_close(total, whole, atol=1e-4, rtol=1e-4)


def test_the_layer_replays_from_a_cuda_graph():
    layer = cuda_layer(torch.float16)
    x = inputs(64, seed=5).to("cuda", torch.float16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        x.copy_(inputs(64, seed=6).to("cuda", torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, layer(x), atol=0, rtol=0)
