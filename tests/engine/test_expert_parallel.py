"""Expert parallelism in the engine (fp32, CPU, gloo): the tiny Qwen3-VL-MoE checkpoint at
TP = EP = 2 and 4 against TP = 1 and transformers, each rank's share of the experts, the
per-rank partial outputs of one MoE layer, and the layouts that are refused. GPU (bf16, device
tool, never in CI): each rank's grouped forward has no host read and the parts sum to the
one-rank layer on the GPU's grouped GEMM.

The tiny MoE checkpoint has 8 experts (top 2), 4 attention heads and 2 KV heads, and one dense
layer (``mlp_only_layers``), so TP = 4 also covers replicated KV heads and a dense MLP split
next to the experts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import ModelLoadError
from services.engine import loader
from services.engine.config import ModelConfig
from services.engine.loader import load_model, tp_shards
from services.engine.model.moe import EXPERT_TENSORS, SparseMoE, route
from services.engine.parallel import TensorParallel, check_tensor_parallel
from tests.conftest import TINY_MODEL_DIR
from tests.engine.test_moe import HIDDEN, NUM_EXPERTS, TOP_K, inputs, random_layer
from tests.engine.test_moe_graphs import _cuda_layer
from tests.engine.test_tensor_parallel import (
    NUM_DECODE_STEPS,
    assert_logits_match,
    reference_run,
    spy_whole_reads,
)
from tests.engine.tp_ranks import run_tp_groups

MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
WORLD, SIZES = 4, (2, 4)


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """The TP = 1 and transformers reference, and every rank's results at TP = EP = 2 and 4
    from one spawn of 4 processes."""
    reference, requests = reference_run(MOE_DIR)
    jobs = [(MOE_DIR, requests)]
    tmp = tmp_path_factory.mktemp("ep")
    results = run_tp_groups(WORLD, SIZES, jobs, tmp, expert_parallel=True)
    return reference, results


def expert_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith(EXPERT_TENSORS)}


def test_the_checkpoint_splits_over_the_sizes_tested():
    moe = ModelConfig.from_dir(MOE_DIR).text.moe
    assert moe is not None and moe.num_experts == 8
    assert all(moe.num_experts % size == 0 and moe.num_experts > size for size in SIZES)


@pytest.mark.parametrize("size", SIZES)
def test_logits_match_tp1_and_transformers(ep_runs, size):
    reference, results = ep_runs
    for rank in range(size):
        assert_logits_match(reference, results[0, size, rank])


@pytest.mark.parametrize("size", SIZES)
def test_greedy_tokens_match_tp1(ep_runs, size):
    reference, results = ep_runs
    assert all(len(t) == NUM_DECODE_STEPS for t in reference.token_ids)
    for rank in range(size):
        assert results[0, size, rank].token_ids == reference.token_ids


@pytest.mark.parametrize("size", SIZES)
def test_each_rank_holds_its_share_of_the_experts(ep_runs, size):
    _, results = ep_runs
    full = expert_params(load_model(MOE_DIR, components=("language",)))
    full_bytes = sum(p.numel() * p.element_size() for p in full.values())
    for rank in range(size):
        assert results[0, size, rank].expert_bytes * size == full_bytes


@pytest.mark.parametrize("size", SIZES)
def test_expert_shards_are_slices_of_the_checkpoint_read_alone(size, monkeypatch):
    """Each rank's experts are its consecutive slice of the TP = 1 ones, together they cover
    every expert of every layer, and the loader never reads an expert tensor whole."""
    full = expert_params(load_model(MOE_DIR, components=("language",)))
    whole_reads = spy_whole_reads(monkeypatch)
    covered: dict[str, list[int]] = {name: [] for name in full}
    for rank in range(size):
        tp = TensorParallel(rank, size, ep_size=size)
        model = load_model(MOE_DIR, components=("language",), tp=tp)
        shards = tp_shards(model)
        for name, param in expert_params(model).items():
            shard = shards[name]
            assert (shard.dim, shard.size, shard.total) == (0, 8 // size, 8)
            torch.testing.assert_close(param, full[name][shard.index(3)])
            covered[name].extend(range(shard.start, shard.start + shard.size))
    assert whole_reads, "the routers and norms are read whole"
    assert not [k for k in whole_reads if loader.canonical_name(k).endswith(EXPERT_TENSORS)]
    assert all(sorted(experts) == list(range(8)) for experts in covered.values())


def rank_layer(full: SparseMoE, rank: int, size: int) -> SparseMoE:
    """``full``'s router and this rank's experts, prepared as the loader leaves them."""
    layer = SparseMoE(HIDDEN, full.moe, "silu", TensorParallel(rank, size, ep_size=size))
    layer = layer.to(full.gate.weight.device, full.gate.weight.dtype)
    held = layer.expert_shard.index(3)
    with torch.no_grad():
        layer.gate.weight.copy_(full.gate.weight)
        layer.experts.gate_up_proj.copy_(full.experts.gate_up_proj[held])
        layer.experts.down_proj.copy_(full.experts.down_proj[held])
    layer.fuse_projections()
    return layer


@pytest.mark.parametrize("size", [2, 3, 6])
@pytest.mark.parametrize("routing", ["random", "one expert"])
def test_ranks_partial_outputs_sum_to_the_whole_layer(size, routing):
    """Both forwards of each rank give its experts' part; the parts sum to the one-rank
    layer, also when every token picks the same experts (the other ranks hold no pair)."""
    full = random_layer()
    x = inputs(40)
    with torch.no_grad():
        weights, experts = route(full.gate(x), TOP_K, full.moe.norm_topk_prob)
        if routing == "one expert":
            experts = torch.tensor([[1, 4]]).expand_as(experts).contiguous()
        whole = full.reference_forward(x, weights, experts)
        grouped, reference = torch.zeros_like(x), torch.zeros_like(x)
        for rank in range(size):
            layer = rank_layer(full, rank, size)
            assert layer.experts.down_proj.shape[0] == NUM_EXPERTS // size
            part = layer.pairs_forward(x, weights, experts, "grouped")
            torch.testing.assert_close(part, layer.reference_forward(x, weights, experts))
            grouped += part
            reference += layer.reference_forward(x, weights, experts)
    torch.testing.assert_close(grouped, whole)
    torch.testing.assert_close(reference, whole)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 3])
def test_bf16_rank_parts_have_no_host_read_and_sum_to_the_layer(cuda, size):
    full = _cuda_layer(random_layer(fused=False).to(cuda), torch.bfloat16)
    x = inputs(64, seed=2).to(cuda, torch.bfloat16)
    with torch.no_grad():
        weights, experts = route(full.gate(x), TOP_K, full.moe.norm_topk_prob)
        whole = full.pairs_forward(x, weights, experts, "grouped")
        parts = []
        for rank in range(size):
            layer = rank_layer(full, rank, size)
            assert not layer.syncs_host
            torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
            try:
                parts.append(layer.pairs_forward(x, weights, experts, "grouped"))
            finally:
                torch.cuda.set_sync_debug_mode("default")
    scale = whole.abs().max().item()
    torch.testing.assert_close(sum(parts), whole, rtol=2e-2, atol=1e-2 * scale)


def moe_text(num_experts: int = 8):
    text = ModelConfig.from_dir(MOE_DIR).text
    assert text.moe is not None
    return dataclasses.replace(text, moe=dataclasses.replace(text.moe, num_experts=num_experts))


@pytest.mark.parametrize(
    ("text", "tp_size", "ep_size", "message"),
    [
        (moe_text(6), 4, 4, "expert parallel size 4 does not divide the 6 experts"),
        (moe_text(8), 3, 3, "expert parallel size 3 does not divide the 8 experts"),
        (moe_text(8), 2, 1, "tensor parallel size 2 on an MoE model needs expert parallel size 2"),
        (moe_text(8), 4, 2, "expert parallel size 2 with tensor parallel size 4: only"),
        (moe_text(8), 1, 2, "expert parallel size 2 with tensor parallel size 1: only"),
        (ModelConfig.from_dir(TINY_MODEL_DIR).text, 2, 2, "size 2 on a dense model: no experts"),
    ],
)
def test_layouts_not_built_or_not_dividing_are_refused(text, tp_size, ep_size, message):
    with pytest.raises(ModelLoadError, match=message):
        check_tensor_parallel(text, tp_size, ep_size)


def test_loader_refuses_an_expert_layout_it_cannot_build():
    with pytest.raises(ModelLoadError, match="needs expert parallel size 4"):
        load_model(MOE_DIR, tp=TensorParallel(0, 4))
    with pytest.raises(ModelLoadError, match="on a dense model"):
        load_model(TINY_MODEL_DIR, tp=TensorParallel(0, 2, ep_size=2))
    check_tensor_parallel(moe_text(8), 4, 4)
    check_tensor_parallel(moe_text(8), 1, 1)
