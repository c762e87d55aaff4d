"""The Triton kernels (CUDA path of services/engine/ops.py) against their torch definitions."""

from __future__ import annotations

import pytest
import torch

from services.engine import ops
from services.engine.model.rope import apply_rotary

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    torch.manual_seed(0)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hidden", [3584, 1280, 64])
def test_rms_norm_and_fused_residual(hidden):
    x = torch.randn(37, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    ref = ops.rms_norm(x.cpu(), weight.cpu(), 1e-6)
    _close(ops.rms_norm(x, weight, 1e-6), ref)
    out, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_sum = ops.add_rms_norm(x.cpu(), residual.cpu(), weight.cpu(), 1e-6)
    assert torch.equal(summed.cpu(), ref_sum)
    _close(out, ref_out)


@pytest.mark.parametrize(("num_q", "num_kv", "head_dim"), [(28, 4, 128), (4, 2, 16)])
def test_rotary_in_place_matches_reference(num_q, num_kv, head_dim):
    n = 19
    qkv = torch.randn(n, (num_q + 2 * num_kv) * head_dim, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(n, head_dim // 2, device="cuda") * 100
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16()
    sin = torch.cat([angles.sin(), angles.sin()], -1).bfloat16()
    ref = qkv.float().cpu()
    q_ref = apply_rotary(
        ref[:, : num_q * head_dim].view(n, num_q, head_dim), cos.float().cpu(), sin.float().cpu()
    )
    k_ref = apply_rotary(
        ref[:, num_q * head_dim : (num_q + num_kv) * head_dim].view(n, num_kv, head_dim),
        cos.float().cpu(),
        sin.float().cpu(),
    )
    v_ref = ref[:, (num_q + num_kv) * head_dim :].view(n, num_kv, head_dim)
    num_slots = 64
    k_slots = torch.zeros(num_slots, num_kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v_slots = torch.zeros_like(k_slots)
    slots = torch.randperm(num_slots, device="cuda")[:n]
    q, k, v = ops.rotary_qk(qkv, cos, sin, num_q, num_kv, head_dim, (k_slots, v_slots, slots))
    _close(q, q_ref)
    _close(k, k_ref)
    assert torch.equal(v.float().cpu(), v_ref)
    # the fused store put exactly the returned (rotated) k and v at each token's slot, nothing elsewhere
    assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)
    untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


def test_silu_mul():
    gate_up = torch.randn(23, 2 * 18944, device="cuda", dtype=torch.bfloat16)
    out = ops.gated_act(gate_up, "silu", torch.nn.functional.silu)
    gate, up = gate_up.float().cpu().chunk(2, dim=-1)
    _close(out, torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize(
    ("n_out", "k_in", "bias"),
    [
        (4608, 3584, True),
        (3584, 3584, False),
        (37888, 3584, False),
        (3584, 18944, False),
        (1000, 130, True),
        (64, 64, False),
    ],
)
def test_one_row_linear_is_the_gemv_kernel_and_matches_fp32(n_out, k_in, bias):
    x = torch.randn(1, k_in, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) / k_in**0.5
    b = torch.randn(n_out, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    out = ops.linear(x, weight, b)
    assert out.shape == (1, n_out) and out.dtype == torch.bfloat16
    _close(out, ref)
    # two rows take cuBLAS; both paths agree on the shared row
    _close(ops.linear(torch.cat([x, x]), weight, b)[:1], out)


@pytest.mark.parametrize(("n_out", "inter"), [(3584, 18944), (64, 96)])
def test_gated_linear_is_silu_mul_then_the_gemv(n_out, inter):
    gate_up = torch.randn(1, 2 * inter, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    act = torch.nn.functional.silu
    ref = torch.nn.functional.linear(ops.gated_act(gate_up, "silu", act).float(), weight.float())
    _close(ops.gated_linear(gate_up, "silu", act, weight), ref)


@pytest.mark.parametrize(("num_kv", "head_dim"), [(4, 128), (2, 16)])
def test_store_kv_writes_each_token_to_its_slot(num_kv, head_dim):
    num_q, n, num_slots = 7 * num_kv, 9, 64
    qkv = torch.randn(n, (num_q + 2 * num_kv) * head_dim, device="cuda", dtype=torch.bfloat16)
    _, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    k, v = (
        k.view(n, num_kv, head_dim),
        v.view(n, num_kv, head_dim),
    )  # strided views, as after rotary
    slots = torch.randperm(num_slots, device="cuda")[:n]
    k_slots = torch.zeros(num_slots, num_kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v_slots = torch.zeros_like(k_slots)
    ops.store_kv(k_slots, v_slots, slots, k, v)
    ref_k, ref_v = torch.zeros_like(k_slots), torch.zeros_like(v_slots)
    ref_k.index_copy_(0, slots, k)
    ref_v.index_copy_(0, slots, v)
    assert torch.equal(k_slots, ref_k) and torch.equal(v_slots, ref_v)


@pytest.mark.parametrize(
    ("num_heads", "head_dim"), [(16, 80), (2, 16)]
)  # the 7B ViT (half 40), the tiny one
def test_vision_rotary_kernel_matches_the_fp32_reference(num_heads, head_dim):
    n = 300
    qkv = torch.randn(n, 3 * num_heads * head_dim, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(n, head_dim // 2, device="cuda") * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref = ops.rotary_qk_fp32(qkv.cpu(), cos.cpu(), sin.cpu(), num_heads, head_dim)
    out = ops.rotary_qk_fp32(qkv.clone(), cos, sin, num_heads, head_dim)
    for got, want in zip(out, ref, strict=True):
        assert got.shape == want.shape == (n, num_heads, head_dim)
        _close(got, want)
    assert torch.equal(out[2].cpu(), ref[2])  # v untouched
