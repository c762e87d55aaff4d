"""The MoE layer benchmark's report (``benchmarks/moe_layer.py``): one measured row, its table
cells, and the verdict on issue 36's target."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.model.moe import SparseMoE

TARGET_EFFICIENCY = 0.70  # roofline / ours
TARGET_TOKENS = (256, 8192)  # decode batch 256, prefill 8k


@dataclass(frozen=True)
class Measurement:
    num_tokens: int
    forward: str  # "triton", "grouped" or "reference"
    experts_hit: float  # mean over the layers
    weight_bytes: float  # the hit experts' weights, mean over the layers
    eager_ms: float  # per layer
    graph_ms: float | None  # per layer; None where the layer was not captured
    roofline_ms: float
    bound: str  # "memory" or "compute"

    @property
    def efficiency(self) -> float:  # roofline / ours
        return self.roofline_ms / (self.graph_ms if self.graph_ms is not None else self.eager_ms)


HEADER = (
    "tokens",
    "forward",
    "experts hit",
    "weight MB",
    "eager ms",
    "graph ms",
    "roofline ms",
    "bound",
    "roofline/ours",
)


def _ms(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def row_cells(m: Measurement) -> tuple[str, ...]:
    return (
        f"{m.num_tokens:,}",
        m.forward,
        f"{m.experts_hit:.1f}".removesuffix(".0"),
        f"{m.weight_bytes / 1e6:.1f}",
        _ms(m.eager_ms),
        "-" if m.graph_ms is None else _ms(m.graph_ms),
        _ms(m.roofline_ms),
        m.bound,
        f"{100 * m.efficiency:.0f}%",
    )


def verdict(measurements: list[Measurement], layer: SparseMoE) -> str:
    """Whether the target rows of the forward ``layer`` runs at their token count (the
    engine's) reach ``TARGET_EFFICIENCY`` of their roofline."""
    goal = (
        f"target (issue 36): >= {TARGET_EFFICIENCY:.0%} of the roofline at "
        + " and ".join(f"{t:,} tokens" for t in TARGET_TOKENS)
        + ": "
    )
    found = {
        m.num_tokens: m
        for m in measurements
        if m.num_tokens in TARGET_TOKENS and m.forward == layer.forward_kind(m.num_tokens)
    }
    if not found:
        return goal + "not measured in this run"
    met = all(m.efficiency >= TARGET_EFFICIENCY for m in found.values())
    missing = [f"{t:,}" for t in TARGET_TOKENS if t not in found]
    detail = ", ".join(f"{t:,}: {m.efficiency:.0%}" for t, m in sorted(found.items()))
    forwards = "/".join(sorted({m.forward for m in found.values()}))
    status = ("met" if met else "not met") + f" ({forwards} forward: {detail})"
    return goal + status + (f"; {', '.join(missing)} not measured" if missing else "")
