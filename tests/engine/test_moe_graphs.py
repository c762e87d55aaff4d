"""The MoE layer inside the engine's graphs, and on the GPU.

CPU: the tiny Qwen3-VL-MoE checkpoint through the prefill pieces (padded rows route to
experts too; the real rows' logits and K/V must not change). GPU (bf16, device tool, never
in CI): the grouped forward runs with no host sync and replays from a CUDA graph equal to
eager; its bf16 error against the fp32 reference is at most twice the bf16 reference
forward's own (plus 1% of the output scale) on random, one-hot and tied routings; the MoE
model's decode CUDA graphs and prefill graphs equal its eager steps.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from services.common.paths import BUNDLED_MODEL
from services.engine.loader import load_model
from services.engine.model.moe import SparseMoE, moe_syncs_host, route
from tests.engine import test_cuda_graph, test_prefill_graph
from tests.engine.test_moe import TOP_K, inputs, random_layer

MOE_DIR = BUNDLED_MODEL.parent / "tiny-qwen3-vl-moe"


def test_the_moe_model_through_the_prefill_pieces_equals_the_eager_pass_on_the_cpu():
    model = load_model(MOE_DIR, "cpu", "float32", components=("language",))
    assert any(isinstance(m, SparseMoE) and m.gate_up_t is not None for m in model.modules())
    test_prefill_graph._compare(model, "torch", (8, 32), rtol=0.0, atol=1e-5)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def moe_config_dir(tmp_path_factory):
    """The tiny MoE checkpoint's config with head dim 128 (flashinfer has kernels for it), bf16."""
    raw = json.loads((MOE_DIR / "config.json").read_text())
    raw["text_config"].update(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        moe_intermediate_size=128,
        rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20]},
    )
    raw["vision_config"]["out_hidden_size"] = 256
    raw["torch_dtype"] = "bfloat16"
    path = tmp_path_factory.mktemp("moe128")
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _cuda_layer(layer: SparseMoE, dtype: torch.dtype) -> SparseMoE:
    """``layer`` in ``dtype``, prepared for the grouped forward; skips where that syncs."""
    layer = layer.to(dtype)
    layer.fuse_projections()
    if layer.syncs_host:
        pytest.skip("torch's grouped GEMM reads the offsets on the host on this GPU")
    return layer


@pytest.mark.gpu
def test_the_layer_has_no_host_sync_and_its_graph_replays_equal_eager(cuda):
    layer = _cuda_layer(random_layer(fused=False).to(cuda), torch.bfloat16)
    static = inputs(64, seed=1).to(cuda, torch.bfloat16)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
        try:
            layer(static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static)
        for seed in (2, 3, 4):  # new tokens each replay: new routings
            x = inputs(64, seed=seed).to(cuda, torch.bfloat16)
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, layer(x)), "the same kernels on the same inputs"


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["random", "one hot expert", "tied"])
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_bf16_layer_is_as_close_to_fp32_as_the_bf16_reference(cuda, routing, num_tokens):
    fp32 = random_layer(fused=False).to(cuda)
    with torch.no_grad():
        if routing == "one hot expert":
            fp32.gate.weight[0] = fp32.gate.weight.abs().sum(0)
        elif routing == "tied":
            fp32.gate.weight[4] = fp32.gate.weight[1]
    bf16 = _cuda_layer(copy.deepcopy(fp32), torch.bfloat16)
    x = inputs(num_tokens, seed=8).to(cuda)
    with torch.no_grad():
        w32, e32 = route(fp32.gate(x), TOP_K, True)
        ref = fp32.reference_forward(x, w32, e32)
        xb = x.bfloat16()
        wb, eb = route(bf16.gate(xb), TOP_K, True)
        ours = bf16(xb).float()
        peer = bf16.reference_forward(xb, wb, eb).float()
    same = (eb.sort(-1).values == e32.sort(-1).values).all(-1)  # a bf16 flip is not an error
    assert int(same.sum()) >= max(1, num_tokens // 2), "most tokens route alike in bf16"
    our_err = (ours - ref)[same].abs().max().item()
    peer_err = (peer - ref)[same].abs().max().item()
    print(f"{routing}, {num_tokens} tokens: bf16 error {our_err:.4f}, reference {peer_err:.4f}")
    assert our_err <= 2 * peer_err + 0.01 * ref.abs().max().item()


@pytest.mark.gpu
def test_the_moe_models_decode_graphs_equal_eager(cuda, moe_config_dir):
    pytest.importorskip("flashinfer")
    from benchmarks.random_model import build_random_model

    torch.manual_seed(0)
    model = build_random_model(moe_config_dir, seed=1)
    if moe_syncs_host(model):
        pytest.skip("torch's grouped GEMM reads the offsets on the host on this GPU")
    test_cuda_graph._compare(model)


@pytest.mark.gpu
def test_the_moe_models_prefill_graphs_equal_eager(cuda, moe_config_dir):
    pytest.importorskip("flashinfer")
    from benchmarks.random_model import build_random_model

    model = build_random_model(moe_config_dir, seed=5)
    if moe_syncs_host(model):
        pytest.skip("torch's grouped GEMM reads the offsets on the host on this GPU")
    test_prefill_graph._compare(model, "flashinfer", (16, 32), rtol=0.05, atol=0.05)
