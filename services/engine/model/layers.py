"""Small building blocks shared by the vision tower and the language model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import fp8, ops
from services.engine.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
from services.engine.parallel import SINGLE, TensorParallel

PAD_INTERMEDIATE = (
    64  # fused MLPs round their intermediate size up to this (see GatedMLP.fuse_projections)
)

ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual add fused with the norm; with no
        residual yet (``x`` starts the stream), ``(norm(x), x)``."""
        if residual is None:
            return self(x), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) along the output dim and re-point each layer at its slice.

    The per-layer parameters stay (as views), so names and state dicts are unchanged.
    """
    weight = torch.cat([layer.weight.detach() for layer in linears])  # [sum(out), in]
    has_bias = [layer.bias is not None for layer in linears]
    assert all(has_bias) or not any(has_bias), "fuse only layers that all have, or all lack, a bias"
    bias = torch.cat([layer.bias.detach() for layer in linears]) if all(has_bias) else None
    start = 0
    for layer in linears:
        end = start + layer.weight.shape[0]  # padded rows included (GatedMLP)
        layer.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def use_fp8(
    layer: ColumnParallelLinear | RowParallelLinear, weight: torch.Tensor, scale: torch.Tensor
) -> None:
    """Point ``layer`` at e4m3 ``weight`` [out, in] (a view of a fused one) and its ``scale``
    [out]."""
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = scale


class GatedMLP(nn.Module):
    """SwiGLU-style MLP: ``down(act(gate(x)) * up(x))``. Under tensor parallelism gate and up are
    column-parallel and down row-parallel (its all-reduce ends the MLP): each rank holds
    ``intermediate_size / tp.size`` of the intermediate features."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        shard = tp.split(intermediate_size, dim=0)
        self.gate_proj = ColumnParallelLinear(hidden_size, shard, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden_size, shard, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        self.act_name = act
        self.act = activation(act)
        self.gate_up_weight: torch.Tensor | None = None  # [2I', hidden] once fused (I' = I padded)
        self.gate_up_bias: torch.Tensor | None = None
        self.down_weight: torch.Tensor | None = None  # [hidden, I'] once fused
        self.gate_up_scale: torch.Tensor | None = None  # [2I'] fp32 with FP8 weights
        self.down_scale: torch.Tensor | None = None  # [hidden] fp32 with FP8 weights

    def fuse_projections(self) -> None:
        """One [2I', hidden] matmul for gate and up (called after the weights are loaded).

        I' is this rank's intermediate size rounded up to a multiple of ``PAD_INTERMEDIATE``,
        with zero rows (gate, up) and zero columns (down): the padded activations are
        act(0) * 0 = 0, so the output is unchanged, and the down matmul gets 16-byte aligned
        rows (the ViT's unaligned 3420 made cuBLAS fall back to a slower kernel). The per-layer
        parameters stay, as views.
        """
        inter = self.gate_proj.out_features
        padded = -(-inter // PAD_INTERMEDIATE) * PAD_INTERMEDIATE
        if padded != inter:
            for layer in (self.gate_proj, self.up_proj):
                layer.weight = nn.Parameter(
                    F.pad(layer.weight.detach(), (0, 0, 0, padded - inter)), requires_grad=False
                )
                if layer.bias is not None:
                    layer.bias = nn.Parameter(
                        F.pad(layer.bias.detach(), (0, padded - inter)), requires_grad=False
                    )
        self.gate_up_weight, self.gate_up_bias = fuse_linears(self.gate_proj, self.up_proj)
        for layer in (
            self.gate_proj,
            self.up_proj,
        ):  # back to the checkpoint's shape, as views of the fused weight
            layer.weight = nn.Parameter(layer.weight[:inter], requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(layer.bias[:inter], requires_grad=False)
        down = self.down_proj.weight.detach()
        self.down_weight = F.pad(down, (0, padded - inter)) if padded != inter else down
        self.down_proj.weight = nn.Parameter(self.down_weight[:, :inter], requires_grad=False)

    def quantize_fp8(self) -> None:
        """FP8 fused weights (called after ``fuse_projections``), scales per output channel
        (the zero padding rows get the all-zero rows' scale); the per-layer parameters stay, as
        e4m3 views with their scales."""
        assert self.gate_up_weight is not None and self.down_weight is not None
        inter = self.gate_proj.out_features
        padded = self.gate_up_weight.shape[0] // 2
        self.gate_up_weight, self.gate_up_scale = fp8.quantize_weight(self.gate_up_weight)
        for layer, start in ((self.gate_proj, 0), (self.up_proj, padded)):
            rows = slice(start, start + inter)
            use_fp8(layer, self.gate_up_weight[rows], self.gate_up_scale[rows])
        self.down_weight, self.down_scale = fp8.quantize_weight(self.down_weight)
        use_fp8(self.down_proj, self.down_weight[:, :inter], self.down_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate_up = ops.linear(
            x, self.gate_up_weight, self.gate_up_bias, self.gate_up_scale
        )  # [T, 2I']
        return self.down_proj.reduce(
            ops.gated_linear(
                gate_up,
                self.act_name,
                self.act,
                self.down_weight,
                self.down_proj.local_bias,
                self.down_scale,
            )
        )
