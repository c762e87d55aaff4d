"""The MoE layer against its grouped-GEMM roofline, at Qwen3-VL-30B-A3B's text dimensions.

    python -m benchmarks.moe_layer [--out docs/benchmarks.md] [--tokens 1,64,256,8192] [--iters 20]
        [--sweep]
    python -m benchmarks.moe_layer --quick      # CPU, tiny dims; a section only with --out

For each token count and each forward the device has (on CUDA: the Triton grouped GEMM the engine
runs, and torch's grouped GEMM): one ``SparseMoE`` forward (router gate, routing, both expert
GEMMs, the weighted sum), eager and replayed from a CUDA graph, against its roofline: the weights
of the experts its routing hit plus its input and output over the measured copy bandwidth, or its
expert FLOPs over the measured bf16 matmul rate, whichever is longer. Target (issue 36): >= 70% of
the roofline at decode batch 256 and prefill 8k, on the engine's forward. ``--sweep`` also times
the Triton forward under each candidate tile shape (``SWEEP``), the table ``triton_moe``'s
choices come from.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from benchmarks.measure import Ceilings, measure_ceilings, time_ms
from benchmarks.moe_layer_table import HEADER, Measurement, row_cells, verdict
from benchmarks.report import command_line, markdown_table, write_run_section
from services.engine.config import MoEConfig
from services.engine.model import moe as moe_module
from services.engine.model.moe import GROUPED_MAX_TOKENS, SparseMoE, route

SECTION_TITLE = "## MoE layer (`python -m benchmarks.moe_layer`)"
ACT = "silu"
DTYPE = torch.bfloat16
WEIGHT_STD = 0.02  # the checkpoints' initializer_range: activations stay O(1)
# Qwen3-VL-30B-A3B's text_config (docs/design.md quotes its config.json)
HIDDEN_30B = 2048
MOE_30B = MoEConfig(128, 8, 768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
HIDDEN_QUICK = 64
MOE_QUICK = MoEConfig(8, 2, 32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
NUM_LAYERS = 8  # distinct weights run back to back: no layer's experts stay in L2 (50 MB)
NUM_LAYERS_QUICK = 2
# Tile shapes the sweep tries: (block_m, block_n, block_k, group_m, num_warps, num_stages)
SWEEP = (
    (16, 64, 128, 1, 4, 4),
    (16, 128, 128, 1, 4, 3),
    (32, 64, 128, 8, 4, 4),
    (32, 128, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 4),
    (64, 128, 64, 8, 8, 4),
    (64, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
)
NOTES = [
    "How to read it: each row is one MoE layer's forward over that many tokens: decode batch "
    "1, 64 and 256 are one token per request, 8,192 is one prefill chunk. The time includes "
    "the router gate (the `[E, hidden]` linear), the fp32 softmax and top-k, the sort of the "
    "(token, expert) pairs by expert, both expert GEMMs (gate/up then down) with the fused "
    "SiLU-and-multiply between them, and the weighted sum back to one row per token. Forward "
    "*triton* is the engine's on CUDA: Triton grouped GEMMs over each expert's pairs padded "
    "to whole row blocks, the first gathering its token rows itself, the second applying the "
    "routing weight and writing each pair's row in token order; *grouped* gathers the rows in"
    " expert order, runs `torch._grouped_mm` twice and puts the weighted rows back in token "
    f"order before the sum. {NUM_LAYERS} layers of distinct random weights run back to back on"
    " the same input and the time is divided by their number, so each layer reads its experts"
    " from HBM, as in the 48-layer model, not from the L2 cache; the median of the timed runs"
    " after a warm-up, between CUDA events. Eager launches every kernel from Python; graph "
    "replays the same layers captured in one CUDA graph, as the engine's decode steps run "
    "(captured only where the layer has no host sync: the Triton forward, or torch's in bf16 "
    "on SM 9.x / 10.x).",
    "",
    "Experts hit: distinct experts the routing picked in that call (mean over the layers); "
    "weight MB: their gate/up and down weights, read once each. Roofline ms: the larger of "
    "(weight bytes + the input and output activations) over the measured copy bandwidth "
    "(memory) and 2 x tokens x top-k x (hidden x 2 x intermediate + intermediate x hidden) "
    "FLOPs over the measured bf16 matmul rate (compute); the bound column says which. The "
    "router gate's weight (0.5 MB) and FLOPs (under 1% of the experts'), the routing and the "
    "intermediate activations are in our time but not in the roofline. Roofline/ours uses the "
    "graph's time where it was captured, else the eager one; 100% is the hardware limit.",
]


def build_layers(
    hidden: int, moe: MoEConfig, num_layers: int, device: torch.device, seed: int = 0
) -> list[SparseMoE]:
    """``num_layers`` MoE layers with seeded random bf16 weights made on ``device`` (nothing is
    initialized on the CPU first), prepared for the grouped forward."""
    generator = torch.Generator(device=device).manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        with torch.device("meta"):
            layer = SparseMoE(hidden, moe, ACT).to(DTYPE)
        layer = layer.to_empty(device=device).requires_grad_(False)
        for param in layer.parameters():
            param.normal_(0.0, WEIGHT_STD, generator=generator)
        layer.fuse_projections()
        layers.append(layer)
    return layers


def expert_bytes(layer: SparseMoE) -> int:
    """Bytes of one expert's weights: gate/up ``[2I, hidden]`` and down ``[hidden, I]``."""
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    return (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()


def expert_flops(num_tokens: int, hidden: int, moe: MoEConfig) -> float:
    inter = moe.moe_intermediate_size
    return 2 * num_tokens * moe.num_experts_per_tok * (hidden * 2 * inter + inter * hidden)


def _cpu_ceilings() -> Ceilings:
    """The CPU's copy bandwidth and bf16 matmul rate, small (for the smoke run's roofline)."""
    src = torch.rand(2**22, dtype=DTYPE)
    dst = torch.empty_like(src)
    copy_s = _cpu_time_ms(lambda: dst.copy_(src), iters=5) / 1e3
    a, b = torch.randn(256, 256, dtype=DTYPE), torch.randn(256, 256, dtype=DTYPE)
    matmul_s = _cpu_time_ms(lambda: a @ b, iters=5) / 1e3
    return Ceilings(2 * src.numel() * src.element_size() / copy_s, 2 * 256**3 / matmul_s)


def _cpu_time_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _graph_ms(fn: Callable[[], object], iters: int) -> float:
    """``fn`` captured in one CUDA graph (warmed up on a side stream first), replays timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = time_ms(graph.replay, warmup=3, iters=iters)
    del graph
    torch.cuda.empty_cache()
    return ms


def can_capture(layers: list[SparseMoE], device: torch.device) -> bool:
    return device.type == "cuda" and not any(layer.syncs_host for layer in layers)


def forward_names(layers: list[SparseMoE], num_tokens: int) -> list[str]:
    """The engine's forward at ``num_tokens`` first, then torch's grouped GEMM where the engine
    runs Triton there."""
    name = layers[0].forward_kind(num_tokens)
    return [name, "grouped"] if name == "triton" else [name]


@contextlib.contextmanager
def running(layers: list[SparseMoE], name: str) -> Iterator[None]:
    """The layers run forward ``name`` (the engine's, or "grouped" in place of "triton")."""
    saved = [(layer.kernels, layer.syncs_host) for layer in layers]
    if name == "grouped":
        for layer in layers:
            layer.kernels, layer.syncs_host = None, not layer.grouped_captures
    try:
        yield
    finally:
        for layer, (kernels, syncs_host) in zip(layers, saved, strict=True):
            layer.kernels, layer.syncs_host = kernels, syncs_host


@torch.no_grad()
def measure(
    layers: list[SparseMoE], num_tokens: int, iters: int, ceilings: Ceilings
) -> Measurement:
    """One ``num_tokens`` forward of each layer (random input), per layer, and its roofline."""
    first = layers[0]
    hidden, moe, device = first.gate.in_features, first.moe, first.gate.weight.device
    x = torch.randn(num_tokens, hidden, dtype=DTYPE, device=device)  # [T, hidden] bf16

    def forward_all() -> None:
        for layer in layers:
            layer(x)

    hits = [
        route(layer.gate(x), moe.num_experts_per_tok, moe.norm_topk_prob)[1].unique().numel()
        for layer in layers
    ]
    experts_hit = statistics.mean(hits)
    weight_bytes = experts_hit * expert_bytes(first)
    activation_bytes = 2 * x.numel() * x.element_size()  # in and out
    memory_ms = (weight_bytes + activation_bytes) / ceilings.copy_bytes_per_s * 1e3
    compute_ms = expert_flops(num_tokens, hidden, moe) / ceilings.matmul_flops_per_s * 1e3
    if device.type == "cuda":
        eager_ms = time_ms(forward_all, warmup=3, iters=iters)
    else:
        eager_ms = _cpu_time_ms(forward_all, iters)
    graph_ms = _graph_ms(forward_all, iters) if can_capture(layers, device) else None
    return Measurement(
        num_tokens=num_tokens,
        forward=first.forward_kind(num_tokens),
        experts_hit=experts_hit,
        weight_bytes=weight_bytes,
        eager_ms=eager_ms / len(layers),
        graph_ms=None if graph_ms is None else graph_ms / len(layers),
        roofline_ms=max(memory_ms, compute_ms),
        bound="memory" if memory_ms >= compute_ms else "compute",
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.moe_layer", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU, tiny dims (a smoke run)")
    p.add_argument("--tokens", default=None, help="comma-separated (default 1,64,256,8192)")
    p.add_argument("--iters", type=int, default=None, help="timed runs (default 20; quick 2)")
    p.add_argument("--out", default=None, help="default docs/benchmarks.md (quick: none)")
    p.add_argument(
        "--sweep", action="store_true", help="also time the Triton forward under each SWEEP tile"
    )
    return p.parse_args(argv)


SWEEP_HEADER = ("tokens", "block m, n, k", "group m", "warps", "stages", "graph ms", "chosen")


def sweep(layers: list[SparseMoE], token_counts: list[int], iters: int) -> list[str]:
    """The Triton forward's graph time under each ``SWEEP`` tile at each token count, the
    fastest marked, and whether ``tile_config`` picks that one: a markdown table."""
    from services.engine import triton_moe

    first = layers[0]
    rows = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, first.gate.in_features, dtype=DTYPE, device="cuda")
        pairs = num_tokens * first.moe.num_experts_per_tok
        chosen = triton_moe.tile_config(pairs)
        timed = []
        for shape in SWEEP:
            tile = triton_moe.TileConfig(*shape)
            with (
                mock.patch.object(triton_moe, "tile_config", lambda _pairs, tile=tile: tile),
                mock.patch.object(moe_module, "GROUPED_MAX_TOKENS", 0),  # Triton at one token too
            ):
                ms = _graph_ms(lambda x=x: [layer(x) for layer in layers], iters) / len(layers)
            timed.append((ms, tile))
            print(f"sweep {num_tokens} {shape}: {ms:.4f} ms", flush=True)
        best = min(ms for ms, _ in timed)
        for ms, tile in timed:
            marks = ("fastest" if ms == best else "") + (" engine's" if tile == chosen else "")
            rows.append(
                (
                    f"{num_tokens:,}",
                    f"{tile.block_m}, {tile.block_n}, {tile.block_k}",
                    str(tile.group_m),
                    str(tile.num_warps),
                    str(tile.num_stages),
                    f"{ms:.3f}",
                    marks.strip() or "-",
                )
            )
    return markdown_table(SWEEP_HEADER, rows)


def _info_lines(
    hidden: int, moe: MoEConfig, layers: list[SparseMoE], ceilings: Ceilings
) -> list[str]:
    dims = (
        f"hidden {hidden}, {moe.num_experts} experts, top-{moe.num_experts_per_tok}, "
        f"expert intermediate {moe.moe_intermediate_size}, norm_topk_prob "
        f"{moe.norm_topk_prob}, {ACT}"
    )
    name = "tiny dims" if hidden == HIDDEN_QUICK else "Qwen3-VL-30B-A3B text dims"
    device = layers[0].gate.weight.device
    forward = layers[0].forward_kind(GROUPED_MAX_TOKENS + 1)
    graph = "yes" if can_capture(layers, device) else "no"
    return [
        f"- layer: {name} ({dims}); random bf16 weights (std {WEIGHT_STD}) and inputs on "
        f"{device.type}; {len(layers)} layers of distinct weights, times per layer",
        f"- engine's forward: {forward} (one-token calls: grouped where it captures, "
        f"`GROUPED_MAX_TOKENS`); CUDA graph: {graph}",
        f"- ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.3g} TB/s (read + write), bf16 "
        f"matmul {ceilings.matmul_flops_per_s / 1e12:.3g} TFLOP/s",
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.quick:
        device, hidden, moe, num_layers = "cpu", HIDDEN_QUICK, MOE_QUICK, NUM_LAYERS_QUICK
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks.moe_layer needs a CUDA GPU (--quick runs on the CPU)")
    else:
        device, hidden, moe, num_layers = "cuda", HIDDEN_30B, MOE_30B, NUM_LAYERS
    default_tokens = "1,16" if args.quick else "1,64,256,8192"
    token_counts = [int(t) for t in (args.tokens or default_tokens).split(",")]
    iters = args.iters or (2 if args.quick else 20)
    out = args.out if args.out is not None else ("" if args.quick else "docs/benchmarks.md")
    layers = build_layers(hidden, moe, num_layers, torch.device(device))
    ceilings = _cpu_ceilings() if args.quick else measure_ceilings()
    info = _info_lines(hidden, moe, layers, ceilings)
    print("\n".join(info), flush=True)
    measurements = []
    for num_tokens in token_counts:
        for name in forward_names(layers, num_tokens):
            with running(layers, name):
                measurements.append(measure(layers, num_tokens, iters, ceilings))
            print(" | ".join(row_cells(measurements[-1])), flush=True)
    table = markdown_table(HEADER, [row_cells(m) for m in measurements])
    info.append(f"- {verdict(measurements, layers[0])}")
    if args.sweep:
        if layers[0].kernels is None:
            raise SystemExit("--sweep times the Triton forward: it needs CUDA and Triton")
        table += ["", "Tile sweep of the Triton forward (graph ms per layer):", ""]
        table += sweep(layers, token_counts, iters)
    print("\n".join(["", *table, "", info[-1]]))
    write_run_section(
        out, SECTION_TITLE, command_line("benchmarks.moe_layer", argv), info, table, NOTES
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
