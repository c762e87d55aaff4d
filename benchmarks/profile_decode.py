"""Where a decode step's time goes: per-kernel GPU time of one eager step, next to the graph replay.

    python -m benchmarks.profile_decode [--batch 1] [--context 1024]

Kernel times come from torch.profiler (CUPTI) over eager steps; their sum against the
CUDA-graph replay time separates slow kernels from launch gaps.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_rows import _decode_steps
from benchmarks.measure import decode_floor_bytes, measure_ceilings, time_ms
from benchmarks.random_model import CONFIG_7B, build_random_model
from services.engine.attention import ForwardMode
from services.engine.model_runner import KVCacheConfig, ModelRunner


def _kernel_table(prof: profile, num_steps: int) -> list[tuple[str, float, int]]:
    """(kernel name, GPU ms per step, launches per step), largest first."""
    rows = []
    for avg in prof.key_averages():
        if avg.device_type == torch.autograd.DeviceType.CUDA:
            rows.append(
                (avg.key[:90], avg.self_device_time_total / 1e3 / num_steps, avg.count // num_steps)
            )
    return sorted(rows, key=lambda r: -r[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.profile_decode")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args(argv)
    ceilings = measure_ceilings()
    model = build_random_model(CONFIG_7B)
    num_pages = args.batch * (args.context // 16 + 2) + 8
    runners = {
        "graph": ModelRunner(model, KVCacheConfig(num_pages, 16), "flashinfer", (args.batch,)),
        "eager": ModelRunner(model, KVCacheConfig(num_pages, 16), "flashinfer", ()),
    }
    request_ids = [f"r{i}" for i in range(args.batch)]
    steps = _decode_steps(request_ids, args.context)
    for runner in runners.values():
        for request_id in request_ids:
            runner.page_table.reserve(request_id, args.context + 1)
        runner.forward(ForwardMode.DECODE, steps)
    graph = runners["graph"].cuda_graph
    assert graph is not None
    replay_ms = time_ms(lambda: graph.replay(args.batch), warmup=3, iters=20)
    eager_ms = time_ms(
        lambda: runners["eager"].forward(ForwardMode.DECODE, steps), warmup=3, iters=10
    )
    num_steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            runners["eager"].forward(ForwardMode.DECODE, steps)
        torch.cuda.synchronize()
    table = _kernel_table(prof, num_steps)
    floor_ms = (
        decode_floor_bytes(model, args.batch, args.context + 1) / ceilings.copy_bytes_per_s * 1e3
    )
    print(
        f"batch {args.batch}, ctx {args.context}: floor {floor_ms:.3f} ms, "
        f"graph replay {replay_ms:.3f} ms, "
        f"eager step {eager_ms:.3f} ms, sum of kernel times {sum(r[1] for r in table):.3f} ms"
    )
    print(f"{'ms/step':>8} {'calls':>6}  kernel")
    for name, ms, calls in table[:25]:
        print(f"{ms:8.3f} {calls:6d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
