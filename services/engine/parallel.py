"""Tensor parallelism in the engine: a rank's place in its TP group, the two collectives the
parallel layers end with, and how a checkpoint's heads, rows, vocabulary and experts split over
ranks. An MoE model's experts are split by expert parallelism over the same ranks (``ep_size``).

Under DP attention (``dp_attention``, decode's ``--dp-attention``) the group is D data-parallel
ranks, each with requests of its own: attention, the embedding and the LM head are whole on
every rank (``TensorParallel.attention`` is ``SINGLE``) and only the MLP and MoE layers split
over the group; each layer's MLP runs on every rank's rows, all-gathered, and each rank keeps
its own rows of the reduced output (``mlp_rows``). Every rank's step then has the same number
of rows: the decode rank pads its batch to the group's agreed size. In a CUDA graph that size
is the graph's (``step_rows`` set to it at capture, so ``mlp_rows`` pads nothing inside): the
rows past a rank's requests are the graph's padding rows, and the collectives (NCCL) are
captured with the rest of the step (cuda_graph.py).

A group of size 1 (``SINGLE``) runs no collective: ``all_reduce`` and ``all_gather`` return
their input, every shard is the whole tensor, and the model is the single-device one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.errors import ModelLoadError
from services.common.rank_devices import local_devices

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from services.engine.config import TextConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a TP group of ``size`` ranks (``group``: the torch.distributed group
    of those ranks, gloo on CPU, NCCL between GPUs; None: the default group). ``ep_size``: the
    ranks an MoE layer's experts are split over, 1 or the whole group (``check_expert_parallel``);
    the expert-parallel rank is then ``rank``."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    ep_size: int = 1
    dp_attention: bool = False  # the group is DP ranks: only the MLP and MoE layers split
    # DP attention: the step's rows per rank, agreed by the group before each forward (the
    # decode rank sets [0], to the graph size that holds them where a graph replays; 0: every
    # rank's x has as many rows, as in the offline engine)
    step_rows: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of {self.size}")

    @property
    def attention(self) -> TensorParallel:
        """The split of attention, the embedding and the LM head: none under DP attention."""
        return SINGLE if self.dp_attention else self

    def mlp_rows(self, mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
        """``mlp(x)`` under DP attention: every rank's rows, padded with zero rows to the
        step's agreed ``step_rows``, all-gathered; the MLP's partial sums over all of them
        (``sum_partials`` leaves them partial) reduce-scattered, and this rank's own rows
        kept. ``mlp(x)`` itself otherwise."""
        if not self.dp_attention or self.size == 1:
            return mlp(x)
        rows, padded = x.shape[0], self.step_rows[0] or x.shape[0]
        assert rows <= padded, f"{rows} rows in a step agreed at {padded}"
        if rows < padded:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        return self.reduce_scatter(mlp(self.all_gather(x, dim=0)))[:rows]

    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        """A split layer's partial sums made whole: all-reduced under TP; under DP attention
        returned partial, for ``mlp_rows`` to reduce-scatter (each rank receives only its rows'
        sums: half the bytes of an all-reduce)."""
        if self.size == 1 or self.dp_attention:
            return x
        return self.all_reduce(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Rank r's ``size``-th of the rows of the sum of every rank's ``x`` (dim 0)."""
        import torch.distributed as dist

        out = x.new_empty(x.shape[0] // self.size, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (``x`` itself for a group of 1)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` for a group of 1)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def split(self, total: int, dim: int) -> Shard:
        """This rank's equal part of ``total`` rows of ``dim``."""
        assert total % self.size == 0, f"{total} does not split over {self.size} ranks"
        size = total // self.size
        return Shard(dim, self.rank * size, size, total)

    def experts(self, num_experts: int) -> Shard:
        """This rank's experts of a layer's ``num_experts`` (dim 0 of its stacked expert tensors):
        its equal part under expert parallelism, else all of them."""
        if self.ep_size == 1:
            return Shard(0, 0, num_experts, num_experts)
        assert self.ep_size == self.size, f"ep {self.ep_size} over a TP group of {self.size}"
        return self.split(num_experts, dim=0)


SINGLE = TensorParallel()


@dataclass(frozen=True)
class Shard:
    """The slice of a checkpoint tensor a rank holds: ``size`` entries of dim ``dim`` from
    ``start``, out of the checkpoint's ``total``."""

    dim: int
    start: int
    size: int
    total: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slice of an ``ndim``-dimensional tensor, for ``tensor[index]``."""
        dims = [slice(None)] * ndim
        dims[self.dim] = slice(self.start, self.start + self.size)
        return tuple(dims)


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads one rank holds: q heads ``q_start ..`` and KV heads ``kv_start ..``.

    With at least ``size`` KV heads each rank holds ``num_kv_heads / size`` of them; with fewer,
    each holds one, the one its q heads read, so ``size / num_kv_heads`` ranks hold a copy of it
    (vLLM's replication); the first of them is its ``is_kv_owner`` (it writes those heads where
    one copy is wanted: the KV handoff).
    """

    num_q_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int
    is_kv_owner: bool = True

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadLayout:
        q_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            kv_heads = num_kv_heads // tp.size
            return cls(q_heads, kv_heads, tp.rank * q_heads, tp.rank * kv_heads)
        copies = tp.size // num_kv_heads
        kv_start = tp.rank * num_kv_heads // tp.size
        return cls(q_heads, 1, tp.rank * q_heads, kv_start, tp.rank % copies == 0)


def check_tensor_parallel(
    text: TextConfig, size: int, ep_size: int = 1, dp_attention: bool = False
) -> None:
    """``ModelLoadError`` naming the numbers when the decoder cannot split over ``size`` ranks:
    heads, KV heads (or ``size`` over them), intermediate size or vocabulary not divisible, or
    experts that cannot split over ``ep_size`` of them (``check_expert_parallel``). Under DP
    attention only the MLP and the experts split."""
    if size < 1:
        raise ModelLoadError(f"tensor parallel size must be at least 1, got {size}")
    check_expert_parallel(text, size, ep_size)
    if size == 1:
        return
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    problems = []
    if heads % size and not dp_attention:
        problems.append(f"the {heads} attention heads")
    if kv_heads % size and size % kv_heads and not dp_attention:
        problems.append(f"the {kv_heads} KV heads (nor does {size} divide by {kv_heads})")
    if text.intermediate_size % size:
        problems.append(f"the intermediate size {text.intermediate_size}")
    if text.vocab_size % size and not dp_attention:
        problems.append(f"the vocabulary of {text.vocab_size}")
    if problems:
        what = "DP attention over" if dp_attention else "tensor parallel size"
        raise ModelLoadError(f"{what} {size} does not divide {', '.join(problems)}")


def check_expert_parallel(text: TextConfig, tp_size: int, ep_size: int) -> None:
    """``ModelLoadError`` naming the numbers unless the MoE layers can split their experts over
    ``ep_size`` of the ``tp_size`` ranks. Built: ``ep_size`` 1 (every expert on every rank, so
    an MoE model only at ``tp_size`` 1: experts have no tensor-parallel split) or ``tp_size``
    on an MoE model whose experts it divides."""
    if ep_size not in (1, tp_size):
        raise ModelLoadError(
            f"expert parallel size {ep_size} with tensor parallel size {tp_size}: only "
            f"expert parallelism over the whole group (ep {tp_size}) or none (ep 1) is built"
        )
    if text.moe is None:
        if ep_size > 1:
            raise ModelLoadError(f"expert parallel size {ep_size} on a dense model: no experts")
        return
    if tp_size > 1 and ep_size == 1:
        raise ModelLoadError(
            f"tensor parallel size {tp_size} on an MoE model needs expert parallel size "
            f"{tp_size}: its experts have no tensor-parallel split"
        )
    if text.moe.num_experts % ep_size:
        raise ModelLoadError(
            f"expert parallel size {ep_size} does not divide the {text.moe.num_experts} experts"
        )


def check_rank_split(
    model_dir: str | Path,
    devices: Sequence[str],
    tp: int,
    ep: int,
    service: str,
    dp_attention: bool = False,
) -> None:
    """``ValueError`` naming the numbers unless ``service``'s rank processes on ``devices``
    split into groups of ``tp`` whose collectives can run (one GPU per CUDA process) and the
    model splits over ``tp`` and ``ep`` (``check_tensor_parallel``). With ``dp_attention`` the
    whole world is one group (``tp`` must be 1) over which only the MLP and experts split."""
    if dp_attention and tp != 1:
        raise ValueError(
            f"{service} --dp-attention with --tp {tp}: a DP-attention rank is one process "
            "(attention whole, the MLP and experts split over every rank); use --tp 1"
        )
    if len(devices) % tp:
        raise ValueError(
            f"{service} --tp {tp} does not divide its {len(devices)} rank processes "
            "(--ranks / --devices count every process: groups x --tp)"
        )
    group = len(devices) if dp_attention else tp
    if group == ep == 1:
        return
    from services.engine.config import ModelConfig

    try:
        check_tensor_parallel(ModelConfig.from_dir(model_dir).text, group, ep, dp_attention)
    except ModelLoadError as exc:
        raise ValueError(f"{service}: {model_dir}: {exc.message}") from exc
    check_group_devices(devices, group, service, "--dp-attention" if dp_attention else f"--tp {tp}")


def check_group_devices(devices: Sequence[str], group: int, service: str, what: str) -> None:
    """``ValueError`` naming the processes unless ``devices`` split, in order, into groups of
    ``group`` whose collectives can run: a group all on CPUs (gloo), or each of its processes
    on a GPU of its own (NCCL). Different groups may share GPUs. ``what``: the flag that made
    the groups (``--tp 2``)."""
    if len(devices) % group:
        raise ValueError(
            f"{service} {what} does not divide its {len(devices)} rank processes "
            "(--ranks / --devices count every process: groups x --tp)"
        )
    for start in range(0, len(devices), group):
        members = devices[start : start + group]
        local = local_devices(members)  # a rank joining from another host has a device of its own
        cuda = [d for d in local if d.startswith("cuda")]
        if 0 < len(cuda) < len(local):
            raise ValueError(
                f"{service} {what} on CPU and CUDA processes at once ({', '.join(members)}): "
                "a group's collectives run over one backend (NCCL on GPUs, gloo on CPUs)"
            )
        if len(set(cuda)) < len(cuda):
            raise ValueError(
                f"{service} {what} on ranks that share a CUDA device ({', '.join(members)}): "
                "the group's collectives run over NCCL, one GPU per rank"
            )
