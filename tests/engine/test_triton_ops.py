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
    q_ref = apply_rotary(ref[:, : num_q * head_dim].view(n, num_q, head_dim), cos.float().cpu(), sin.float().cpu())
    k_ref = apply_rotary(
        ref[:, num_q * head_dim : (num_q + num_kv) * head_dim].view(n, num_kv, head_dim),
        cos.float().cpu(), sin.float().cpu(),
    )
    v_ref = ref[:, (num_q + num_kv) * head_dim :].view(n, num_kv, head_dim)
    q, k, v = ops.rotary_qk(qkv, cos, sin, num_q, num_kv, head_dim)
    _close(q, q_ref)
    _close(k, k_ref)
    assert torch.equal(v.float().cpu(), v_ref)


def test_silu_mul():
    gate_up = torch.randn(23, 2 * 18944, device="cuda", dtype=torch.bfloat16)
    out = ops.gated_act(gate_up, "silu", torch.nn.functional.silu)
    gate, up = gate_up.float().cpu().chunk(2, dim=-1)
    _close(out, torch.nn.functional.silu(gate) * up)
