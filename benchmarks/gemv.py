"""Decode at batch 1: the Triton GEMV against cuBLAS, per projection and for the whole CUDA-graph
step.

    python -m benchmarks.gemv [--context 1024]

Each projection is timed as one CUDA graph of the same projection in all 28 layers (distinct
weights, so nothing stays in L2), per layer; the floor is its weight bytes over the measured
copy bandwidth. Then the whole decode step at batch 1 is captured and replayed twice: with the
one-row ``linear`` routed to the GEMV (the default) and with it routed to cuBLAS.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.engine_rows import _decode_steps
from benchmarks.measure import copy_bytes_per_s, decode_floor_bytes, time_ms
from benchmarks.random_model import CONFIG_7B, build_random_model
from services.engine import ops
from services.engine.attention import ForwardMode
from services.engine.model_runner import KVCacheConfig, ModelRunner


def _graph_ms(fns: list[Callable[[], object]]) -> float:
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return time_ms(graph.replay, warmup=3, iters=20)


def _step_ms(model: torch.nn.Module, context: int) -> float:
    runner = ModelRunner(model, KVCacheConfig(context // 16 + 10, 16), "flashinfer", (1,))
    runner.page_table.reserve("r0", context + 1)
    runner.forward(ForwardMode.DECODE, _decode_steps(["r0"], context))
    graph = runner.cuda_graph
    assert graph is not None
    ms = time_ms(lambda: graph.replay(1), warmup=3, iters=30)
    del runner
    torch.cuda.empty_cache()
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.gemv", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args(argv)
    from services.engine import triton_kernels

    bandwidth = copy_bytes_per_s()
    model = build_random_model(CONFIG_7B)
    layers = model.model.layers
    hidden = model.config.text.hidden_size
    x = torch.randn(1, hidden, dtype=torch.bfloat16, device="cuda")
    act = torch.randn(1, model.config.text.intermediate_size, dtype=torch.bfloat16, device="cuda")
    projections = {  # name: (input, [(weight, bias) per layer])
        "q/k/v": (x, [(layer.self_attn.qkv_weight, layer.self_attn.qkv_bias) for layer in layers]),
        "o": (x, [(layer.self_attn.o_proj.weight, None) for layer in layers]),
        "gate/up": (x, [(layer.mlp.gate_up_weight, None) for layer in layers]),
        "down": (act, [(layer.mlp.down_proj.weight, None) for layer in layers]),
    }
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| GEMV (N x K) | floor us | Triton us | cuBLAS us |\n|---|---|---|---|")
    for name, (inp, weights) in projections.items():
        n, k = weights[0][0].shape
        floor_us = n * k * 2 / bandwidth * 1e6
        ours = _graph_ms(
            [lambda i=inp, w=w, b=b: triton_kernels.gemv(i, w, b) for w, b in weights]
        ) / len(weights)
        ref = _graph_ms(
            [lambda i=inp, w=w, b=b: torch.nn.functional.linear(i, w, b) for w, b in weights]
        ) / len(weights)
        print(f"| {name} {n} x {k} | {floor_us:.1f} | {ours * 1e3:.1f} | {ref * 1e3:.1f} |")
    floor_ms = decode_floor_bytes(model, 1, args.context + 1) / bandwidth * 1e3
    with_gemv = _step_ms(model, args.context)
    routed = ops._gemv_kernels
    ops._gemv_kernels = lambda x, weight: None  # every linear to cuBLAS, for this comparison only
    try:
        with_cublas = _step_ms(model, args.context)
    finally:
        ops._gemv_kernels = routed
    print(
        f"decode batch 1 @{args.context}: floor {floor_ms:.3f} ms; graph replay {with_gemv:.3f} ms "
        f"({with_gemv / floor_ms:.2f}x) with the GEMV, {with_cublas:.3f} "
        f"ms ({with_cublas / floor_ms:.2f}x) with cuBLAS"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
