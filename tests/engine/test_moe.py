"""The MoE layer against transformers' Qwen3-VL-MoE block and against its own reference
forward: routing, experts, unpicked experts, ``norm_topk_prob``, both checkpoint layouts of
the expert weights, the grouped forward's padding and fallback, and that the grouped
forward has no host reads (it traces as one graph)."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import MoEConfig
from services.engine.model.moe import (
    SparseMoE,
    block_layout,
    checkpoint_expert,
    grouped_mm_syncs_host,
    moe_syncs_host,
    route,
)

HIDDEN, NUM_EXPERTS, TOP_K, INTER = 16, 6, 2, 12
UNPICKED = 3


def random_layer(
    norm_topk_prob: bool = True, hidden: int = HIDDEN, inter: int = INTER, fused: bool = True
) -> SparseMoE:
    """Our layer with seeded random weights; expert ``UNPICKED`` gets a router row no positive
    input can pick. ``fused``: prepared for the grouped forward, as the loader leaves it."""
    generator = torch.Generator().manual_seed(0)
    moe = MoEConfig(NUM_EXPERTS, TOP_K, inter, norm_topk_prob, 1, ())
    layer = SparseMoE(hidden, moe, "silu")
    router = torch.randn(NUM_EXPERTS, hidden, generator=generator)
    router[UNPICKED] = -router[UNPICKED].abs() - 1.0
    with torch.no_grad():
        layer.gate.weight.copy_(router)
        gate_up = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=generator) / 4
        layer.experts.gate_up_proj.copy_(gate_up)
        down = torch.randn(NUM_EXPERTS, hidden, inter, generator=generator) / 4
        layer.experts.down_proj.copy_(down)
    if fused:
        layer.fuse_projections()
    return layer


def transformers_block(ours: SparseMoE):
    """transformers' block with ``ours``' weights. Qwen3-VL-MoE's router always renormalizes
    the top-k weights (its config has no ``norm_topk_prob``), so without renormalization the
    peer is Qwen3-MoE's block, which reads the flag and has the same expert layout."""
    from transformers import Qwen3MoeConfig, Qwen3VLMoeTextConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    dims = dict(
        hidden_size=ours.gate.in_features,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=ours.moe.moe_intermediate_size,
    )
    if ours.moe.norm_topk_prob:
        theirs = Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(**dims))
    else:
        theirs = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**dims, norm_topk_prob=False))
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
    return theirs.eval()


def inputs(num_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).abs()


def both_forwards(layer: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's forward, its reference forward) on ``x``."""
    with torch.no_grad():
        weights, experts = route(layer.gate(x), TOP_K, layer.moe.norm_topk_prob)
        return layer(x), layer.reference_forward(x, weights, experts)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 40, 600])
def test_grouped_forward_matches_reference_and_transformers(num_tokens, norm_topk_prob):
    layer = random_layer(norm_topk_prob)
    assert layer.gate_up_t is not None and not layer.syncs_host, "the grouped forward runs"
    x = inputs(num_tokens)
    ours, reference = both_forwards(layer, x)
    assert ours.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        theirs = transformers_block(layer)(x[None])[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    if num_tokens >= 40:
        experts = route(layer.gate(x), TOP_K, norm_topk_prob)[1]
        picked = set(experts.flatten().tolist())
        assert UNPICKED not in picked and len(picked) >= 3, picked
        assert len({tuple(sorted(row)) for row in experts.tolist()}) > 2, "tokens route apart"


def test_an_unpicked_expert_does_not_change_the_output():
    layer = random_layer()
    x = inputs(10, seed=2)
    with torch.no_grad():
        before = layer(x)
        layer.experts.gate_up_proj[UNPICKED].fill_(1e6)
        assert torch.equal(layer(x), before)
        layer.experts.gate_up_proj[int(route(layer.gate(x), TOP_K, True)[1][0, 0])].mul_(2)
        assert not torch.equal(layer(x), before)


@pytest.mark.parametrize("routing", ["tied", "one hot expert"])
def test_grouped_forward_matches_reference_on_skewed_routings(routing):
    layer = random_layer()
    with torch.no_grad():
        if routing == "tied":  # experts 1 and 4 get equal logits for every token
            layer.gate.weight[4] = layer.gate.weight[1]
        else:  # every token picks expert 0, the other experts share the second slot
            layer.gate.weight[0] = layer.gate.weight.abs().sum(0)
    x = inputs(64, seed=3)
    experts = route(layer.gate(x), TOP_K, True)[1]
    if routing == "tied":
        assert bool(((experts == 1) | (experts == 4)).any())
    else:
        assert bool((experts[:, 0] == 0).all())
    ours, reference = both_forwards(layer, x)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_bf16_grouped_forward_matches_the_bf16_reference():
    layer = random_layer(fused=False).to(torch.bfloat16)
    layer.fuse_projections()
    x = inputs(50, seed=4).to(torch.bfloat16)
    ours, reference = both_forwards(layer, x)
    assert ours.dtype == torch.bfloat16
    # the same products; bf16 rounds the k-way sum once here, once per expert there
    torch.testing.assert_close(ours, reference, atol=2e-2, rtol=2e-2)


def blocked_forward(layer: SparseMoE, x: torch.Tensor, block_m: int) -> torch.Tensor:
    """The Triton forward's arithmetic in torch, block by block over ``block_layout``: each
    block's pairs times its expert's weights, written at the pair's row. Rows start as NaN, so
    a pair in no block, or a row written from another pair's input, shows in the result."""
    assert layer.gate_up_t is not None and layer.down_t is not None
    weights, experts = route(layer.gate(x), TOP_K, layer.moe.norm_topk_prob)
    num_pairs = experts.numel()
    _, order, ends = layer.sort_pairs(experts)
    pair_of_slot, block_expert = block_layout(order, ends, block_m)
    gate_up = torch.full((num_pairs, layer.gate_up_t.shape[2]), float("nan"))
    down_in = {}
    for block, expert in enumerate(block_expert.tolist()):
        slots = pair_of_slot[block * block_m : (block + 1) * block_m].long()
        if expert < 0:
            assert bool((slots == num_pairs).all()), "a block past the experts' holds no pair"
            continue
        pairs = slots[slots < num_pairs]
        gate_up[pairs] = x[pairs // TOP_K] @ layer.gate_up_t[expert]
        down_in[block] = (expert, pairs)
    act = layer.act(gate_up.chunk(2, dim=1)[0]) * gate_up.chunk(2, dim=1)[1]
    out = torch.full((num_pairs, x.shape[1]), float("nan"))
    for expert, pairs in down_in.values():
        out[pairs] = (act[pairs] @ layer.down_t[expert]) * weights.flatten()[pairs, None]
    return out.view(-1, TOP_K, x.shape[1]).sum(dim=1)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("routing", ["random", "one hot expert"])
def test_block_layout_puts_every_pair_once_in_a_block_of_its_expert(block_m, routing):
    layer = random_layer()
    if routing == "one hot expert":
        with torch.no_grad():
            layer.gate.weight[0] = layer.gate.weight.abs().sum(0)
    x = inputs(37, seed=8)
    with torch.no_grad():
        experts = route(layer.gate(x), TOP_K, True)[1]
        _, order, ends = layer.sort_pairs(experts)
        pair_of_slot, block_expert = block_layout(order, ends, block_m)
        num_pairs = experts.numel()
        bound = num_pairs + NUM_EXPERTS * (block_m - 1)
        assert pair_of_slot.numel() == -(-bound // block_m) * block_m, "static: T, k, E only"
        assert block_expert.numel() * block_m == pair_of_slot.numel()
        real = pair_of_slot[pair_of_slot < num_pairs].long()
        assert sorted(real.tolist()) == list(range(num_pairs)), "each pair exactly once"
        for block, expert in enumerate(block_expert.tolist()):
            pairs = pair_of_slot[block * block_m : (block + 1) * block_m].long()
            pairs = pairs[pairs < num_pairs]
            assert bool((experts.flatten()[pairs] == expert).all())
        used = block_expert[block_expert >= 0]
        assert bool((used[1:] >= used[:-1]).all()), "blocks in expert order"
        assert set(used.tolist()) == set(experts.flatten().tolist()), "no block of an unpicked one"
        ours = blocked_forward(layer, x, block_m)
        reference = layer.reference_forward(x, *route(layer.gate(x), TOP_K, True))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_unaligned_intermediate_is_padded_with_zeros():
    layer = random_layer(inter=10)  # 40-byte fp32 rows: not a 16-byte multiple
    assert layer.gate_up_t is not None and layer.down_t is not None
    assert layer.gate_up_t.shape == (NUM_EXPERTS, HIDDEN, 128)  # 2 x 64 (PAD_INTERMEDIATE)
    assert layer.down_t.shape == (NUM_EXPERTS, 64, HIDDEN)
    assert layer.experts.gate_up_proj.shape == (NUM_EXPERTS, 20, HIDDEN), "parameters unchanged"
    ours, reference = both_forwards(layer, inputs(30, seed=5))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_unaligned_hidden_keeps_the_reference_forward():
    layer = random_layer(hidden=18)  # 72-byte fp32 rows of x: the grouped GEMM refuses them
    assert layer.gate_up_t is None and layer.syncs_host
    x = torch.randn(7, 18, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        theirs = transformers_block(layer)(x[None])[0]
        torch.testing.assert_close(layer(x), theirs, atol=1e-5, rtol=1e-5)


def test_grouped_forward_traces_as_one_graph_and_the_reference_does_not():
    """``fullgraph`` tracing with a symbolic token count fails on any host read of device
    data (``.tolist()``, ``.item()``) and on any shape that depends on the data: what a CUDA
    graph cannot capture either. (bf16: torch traces its grouped GEMM in bf16 only.)"""
    layer = random_layer(fused=False).to(torch.bfloat16)
    x = inputs(7, seed=7).to(torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(Exception, match="(?i)graph break|data.dependent|tolist|unique"):
            torch.compile(layer.forward, fullgraph=True, backend="eager", dynamic=True)(x)
        layer.fuse_projections()
        traced = torch.compile(layer.forward, fullgraph=True, backend="eager", dynamic=True)
        assert torch.equal(traced(x), layer(x))
        assert traced(x[:0]).shape == (0, HIDDEN)


@pytest.mark.parametrize(
    ("capability", "dtype", "syncs"),
    [
        ((9, 0), torch.bfloat16, False),
        ((10, 0), torch.bfloat16, False),
        ((8, 0), torch.bfloat16, True),
        ((9, 0), torch.float16, True),
        ((9, 0), torch.float32, True),
    ],
)
def test_which_cuda_grouped_gemms_sync(monkeypatch, capability, dtype, syncs):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert grouped_mm_syncs_host(torch.device("cuda", 0), dtype) is syncs
    assert grouped_mm_syncs_host(torch.device("cpu"), dtype) is False


def test_a_model_with_a_reference_layer_syncs(caplog):
    assert not moe_syncs_host(torch.nn.Sequential(random_layer(), random_layer(inter=10)))
    assert moe_syncs_host(torch.nn.Sequential(random_layer(), random_layer(hidden=18)))
    assert "CUDA graphs off" in caplog.text


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_weights_are_the_softmax_top_k(norm_topk_prob):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.5]])
    weights, experts = route(logits, 2, norm_topk_prob)
    probs = torch.softmax(logits, dim=-1)
    assert experts.tolist() == [[0, 1], [2, 1]]
    expected = probs.gather(1, experts)
    if norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights, expected)


def test_checkpoint_expert_takes_either_layout():
    shape = (NUM_EXPERTS, 2 * INTER, HIDDEN)
    stored = torch.randn(shape)
    assert checkpoint_expert(stored, shape) is stored
    released = stored.transpose(1, 2).contiguous()  # [E, hidden, 2I]
    assert torch.equal(checkpoint_expert(released, shape), stored)
    wrong = torch.randn(NUM_EXPERTS + 1, 2 * INTER, HIDDEN)
    assert checkpoint_expert(wrong, shape) is wrong  # left for the loader's shape error


def test_one_token_calls_run_torchs_grouped_gemm_where_it_captures():
    """The Triton forward everywhere it is loaded, but batch-1 decode on torch's grouped GEMM
    where that captures (measured faster there); the reference until the weights are prepared."""
    layer = random_layer(fused=False)
    assert layer.forward_kind(1) == "reference"
    layer.fuse_projections()
    assert (layer.forward_kind(1), layer.forward_kind(64)) == ("grouped", "grouped")  # no Triton
    layer.kernels = object()  # as on CUDA with Triton
    layer.grouped_captures = True  # bf16 on SM 9.x / 10.x
    assert (layer.forward_kind(1), layer.forward_kind(2)) == ("grouped", "triton")
    layer.grouped_captures = False  # fp16, fp32, older GPUs: torch's grouped GEMM syncs
    assert (layer.forward_kind(1), layer.forward_kind(2)) == ("triton", "triton")
