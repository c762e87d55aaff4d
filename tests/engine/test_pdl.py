"""Programmatic dependent launch (PDL) of the Triton kernels changes when they start, never what they compute.

With PDL a kernel starts while the one before it finishes and must wait (``gdc_wait``)
before it touches anything that kernel reads or writes; a missing or misplaced wait is a
race that shows up as wrong numbers in some replays. A decoder-like chain (norm, GEMV,
rotary + KV store, GEMV, norm, GEMV, SiLU-mul, GEMV per layer) is replayed many times as
a CUDA graph with PDL and compared bit for bit with the same chain run eagerly without it.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import ops

pytestmark = pytest.mark.gpu

HIDDEN, NUM_Q, NUM_KV, HEAD_DIM, INTER, LAYERS = 512, 8, 2, 64, 1024, 6


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")


def _weights() -> list[tuple[torch.Tensor, ...]]:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") / shape[-1] ** 0.5).to(torch.bfloat16)

    qkv = (NUM_Q + 2 * NUM_KV) * HEAD_DIM
    return [
        (
            torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5,
            w(qkv, HIDDEN),
            w(qkv).mul(HIDDEN**0.5),
            w(HIDDEN, NUM_Q * HEAD_DIM),
            w(2 * INTER, HIDDEN),
            w(HIDDEN, INTER),
        )
        for _ in range(LAYERS)
    ]


def _chain(x, residual, weights, cos, sin, k_pool, v_pool, slot):
    for layer, (norm, w_qkv, b_qkv, w_o, w_gate_up, w_down) in enumerate(weights):
        h, residual = ops.add_rms_norm(x, residual, norm, 1e-6)
        qkv = ops.linear(h, w_qkv, b_qkv)
        q, _, _ = ops.rotary_qk(
            qkv, cos, sin, NUM_Q, NUM_KV, HEAD_DIM, (k_pool[layer], v_pool[layer], slot)
        )
        x = ops.linear(q.reshape(1, -1), w_o)
        h, residual = ops.add_rms_norm(x, residual, norm, 1e-6)
        x = ops.gated_linear(ops.linear(h, w_gate_up), "silu", torch.nn.functional.silu, w_down)
    return x, residual


def test_graph_replays_with_pdl_match_eager_without_it(monkeypatch):
    from services.engine import triton_kernels

    x_in = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    if not triton_kernels.use_pdl(x_in):
        pytest.skip("PDL needs compute capability 9.0 or later")
    torch.manual_seed(0)
    weights = _weights()
    angles = torch.rand(1, HEAD_DIM // 2, device="cuda") * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    inputs = [
        (
            torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16),
            torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16),
            torch.randint(0, 32, (1,), device="cuda"),
        )
        for _ in range(5)
    ]
    k_pool = torch.zeros(LAYERS, 32, NUM_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)

    with monkeypatch.context() as m:
        m.setattr(triton_kernels, "_pdl_on", lambda index: False)
        expected = []
        for x, residual, slot in inputs:
            out, res = _chain(x, residual, weights, cos, sin, k_pool, v_pool, slot)
            expected.append(
                (out.clone(), res.clone(), k_pool[:, slot].clone(), v_pool[:, slot].clone())
            )

    res_in, slot_in = torch.empty_like(x_in), torch.zeros(1, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the PDL variants) off the capture
        _chain(x_in, res_in, weights, cos, sin, k_pool, v_pool, slot_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _chain(x_in, res_in, weights, cos, sin, k_pool, v_pool, slot_in)
    k_pool.zero_()
    v_pool.zero_()
    for i in range(40):
        x, residual, slot = inputs[i % len(inputs)]
        want_out, want_res, want_k, want_v = expected[i % len(inputs)]
        x_in.copy_(x)
        res_in.copy_(residual)
        slot_in.copy_(slot)
        graph.replay()
        assert torch.equal(out, want_out) and torch.equal(res, want_res), f"replay {i}"
        assert torch.equal(k_pool[:, slot], want_k) and torch.equal(v_pool[:, slot], want_v), (
            f"replay {i}"
        )
