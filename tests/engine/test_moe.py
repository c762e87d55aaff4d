"""The MoE layer against transformers' Qwen3-VL-MoE block: routing, experts, unpicked
experts, ``norm_topk_prob`` and both checkpoint layouts of the expert weights."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import MoEConfig
from services.engine.model.moe import SparseMoE, checkpoint_expert, route

HIDDEN, NUM_EXPERTS, TOP_K, INTER = 16, 6, 2, 12


def moe_config(norm_topk_prob: bool = True) -> MoEConfig:
    return MoEConfig(NUM_EXPERTS, TOP_K, INTER, norm_topk_prob, 1, ())


def layers_with_shared_weights(unpicked: int):
    """Our layer and transformers' block with the same random weights; expert ``unpicked``
    gets a router row no positive input can pick."""
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    generator = torch.Generator().manual_seed(0)
    ours = SparseMoE(HIDDEN, moe_config(), "silu")
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)
    router[unpicked] = -router[unpicked].abs() - 1.0
    with torch.no_grad():
        ours.gate.weight.copy_(router)
        ours.experts.gate_up_proj.copy_(torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN) / 4)
        ours.experts.down_proj.copy_(torch.randn(NUM_EXPERTS, HIDDEN, INTER) / 4)
    config = Qwen3VLMoeTextConfig(
        hidden_size=HIDDEN,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
    )
    theirs = Qwen3VLMoeTextSparseMoeBlock(config).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
    return ours, theirs


def test_layer_matches_transformers_with_tokens_routed_apart_and_an_unpicked_expert():
    ours, theirs = layers_with_shared_weights(unpicked=3)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1)).abs()
    _, experts = route(ours.gate(x), TOP_K, True)
    picked = set(experts.flatten().tolist())
    assert 3 not in picked and len(picked) >= 3, picked
    assert len({tuple(sorted(row)) for row in experts.tolist()}) > 2, "tokens route apart"
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=1e-5, rtol=1e-5)


def test_an_unpicked_expert_does_not_change_the_output():
    ours, _ = layers_with_shared_weights(unpicked=3)
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(2)).abs()
    with torch.no_grad():
        before = ours(x)
        ours.experts.gate_up_proj[3].fill_(1e6)
        assert torch.equal(ours(x), before)
        ours.experts.gate_up_proj[int(route(ours.gate(x), TOP_K, True)[1][0, 0])].mul_(2)
        assert not torch.equal(ours(x), before)


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
