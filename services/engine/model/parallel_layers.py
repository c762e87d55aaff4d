"""Linears and embeddings that know their tensor-parallel split (``services/engine/parallel.py``).

Each holds this rank's slice of its checkpoint tensors and names it in ``tp_shards``
(parameter name -> ``Shard``), which the loader reads with ``get_slice``; a parameter not
named there is replicated. A layer whose output is a partial sum ends with its all-reduce, so
the model code above reads like the single-device model. In a group of 1 each layer is the
plain ``nn.Linear`` / ``nn.Embedding`` it subclasses, with no collective.

With ``--quantization fp8`` a linear's weight is this rank's slice in e4m3 and ``weight_scale``
its scales, one per output channel, computed from the slice (``fp8.py``): a column shard's
scales are the whole tensor's for its rows; a row-parallel shard has a scale for every output,
from its own columns, and its partial products are rescaled before the all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import ops
from services.engine.parallel import Shard, TensorParallel


class ColumnParallelLinear(nn.Linear):
    """Rows ``shard`` of the checkpoint's ``[out, in]`` weight (and of its bias): the output is
    this rank's slice of the features, for a row-parallel layer after it; no collective."""

    def __init__(self, in_features: int, shard: Shard, bias: bool) -> None:
        assert shard.dim == 0, shard
        super().__init__(in_features, shard.size, bias=bias)
        self.tp_shards = {"weight": shard, "bias": shard}
        self.weight_scale: torch.Tensor | None = None  # [out] fp32 with an FP8 weight (fp8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return super().forward(x)
        return ops.linear(x, self.weight, self.bias, self.weight_scale)


class RowParallelLinear(nn.Linear):
    """This rank's columns of the checkpoint's ``[out, in]`` weight: the input is this rank's
    slice of the features, the output the all-reduced sum; the bias is added once, after it.
    Under DP attention the output stays partial (``TensorParallel.sum_partials``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        shard = tp.split(in_features, dim=1)
        super().__init__(shard.size, out_features, bias=bias)
        self.tp = tp
        self.tp_shards = {"weight": shard}
        self.weight_scale: torch.Tensor | None = None  # [out] fp32 with an FP8 weight (fp8.py)

    @property
    def local_bias(self) -> torch.Tensor | None:
        """The bias to add to this rank's partial product: the bias in a group of 1, else None."""
        return self.bias if self.tp.size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(ops.linear(x, self.weight, self.local_bias, self.weight_scale))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's partial product (``local_bias`` included)."""
        if self.tp.size == 1:
            return partial
        out = self.tp.sum_partials(partial)
        if self.bias is None or (self.tp.dp_attention and self.tp.rank):
            return out  # under DP attention rank 0's partial carries the bias into the sum
        return out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary: ids outside them look up zeros, and the all-reduce
    sums the one rank's row that holds each id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        shard = tp.split(num_embeddings, dim=0)
        super().__init__(shard.size, embedding_dim)
        self.tp = tp
        self.tp_shards = {"weight": shard}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, dim]
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.tp_shards["weight"].start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """This rank's rows of the vocabulary (the embedding's rows, so a tied head shares them);
    the logits of every rank are all-gathered, so sampling sees the whole vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        shard = tp.split(vocab_size, dim=0)
        super().__init__(hidden_size, shard.size, bias=False)
        self.tp = tp
        self.tp_shards = {"weight": shard}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        return self.tp.all_gather(ops.linear(hidden, self.weight, self.bias)).float()
