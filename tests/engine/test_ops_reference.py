"""The torch definitions in services/engine/ops.py (the CPU path; test_triton_ops.py holds them to the kernels)."""

from __future__ import annotations

import pytest
import torch

from services.engine import ops
from services.engine.model.rope import apply_rotary


def test_rotary_qk_with_kv_store_writes_the_rotated_k_and_v_to_their_slots():
    torch.manual_seed(0)
    n, num_q, num_kv, head_dim, num_slots = 5, 4, 2, 16, 12
    qkv = torch.randn(n, (num_q + 2 * num_kv) * head_dim)
    angles = torch.rand(n, head_dim // 2) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    k_slots, v_slots = (
        torch.zeros(num_slots, num_kv, head_dim),
        torch.zeros(num_slots, num_kv, head_dim),
    )
    slots = torch.tensor([7, 0, 11, 3, 5])
    q, k, v = ops.rotary_qk(qkv, cos, sin, num_q, num_kv, head_dim, (k_slots, v_slots, slots))
    q_ref, k_ref, v_ref = ops.rotary_qk(qkv, cos, sin, num_q, num_kv, head_dim)  # no store
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.allclose(
        k,
        apply_rotary(
            qkv[:, num_q * head_dim : (num_q + num_kv) * head_dim].reshape(n, num_kv, head_dim),
            cos,
            sin,
        ),
    )
    assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert not k_slots[others].any() and not v_slots[others].any()


def test_one_row_linear_on_cpu_is_f_linear():
    x, weight, bias = torch.randn(1, 24), torch.randn(10, 24), torch.randn(10)
    assert torch.equal(ops.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    gate_up, down = torch.randn(1, 2 * 24), torch.randn(10, 24)
    expected = torch.nn.functional.linear(
        ops.gated_act(gate_up, "silu", torch.nn.functional.silu), down
    )
    assert torch.equal(ops.gated_linear(gate_up, "silu", torch.nn.functional.silu, down), expected)


@pytest.mark.parametrize(("inter", "bias"), [(36, True), (100, False), (64, True)])
def test_fused_mlp_pads_its_intermediate_size_without_changing_the_output(inter, bias):
    from services.engine.model.layers import PAD_INTERMEDIATE, GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(24, inter, "silu", bias=bias)
    x = torch.randn(5, 24)
    with torch.no_grad():
        expected = mlp(x)  # not fused yet: three separate matmuls
        mlp.fuse_projections()
        padded = -(-inter // PAD_INTERMEDIATE) * PAD_INTERMEDIATE
        assert mlp.gate_up_weight.shape == (2 * padded, 24) and mlp.down_weight.shape == (
            24,
            padded,
        )
        assert (
            mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (inter, 24)
        )  # the checkpoint's names
        assert mlp.down_proj.weight.shape == (24, inter)
        torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-5)
