"""A tensor-parallel decode rank (``RankInit.tp_size`` T > 1): a free-running rank group of T
processes, each holding its shard of the model and a KV pool of its own KV heads, registered
with its own KV receiver (prefill writes each pool's heads there, ``KvRefInfo.tp_shards``).

Process 0 runs the ``DecodeRank`` (scheduler, batch, sampling: every decision) and mirrors each
forward to processes 1 .. T-1 (``tp_mirror.py``), which run it (``TpFollower.follow``) so their
shards join its collectives. At start the ranks exchange their pools and step addresses over
the group's CPU collective; rank 0 names every pool in each reservation, with its page ids.
"""

from __future__ import annotations

import torch.distributed as dist

from services.common.destinations import KvPoolLayout
from services.common.ranks.step import RankContext
from services.common.ranks.subgroups import agree_on_manifest, model_manifest
from services.decode.messages import RankInit
from services.decode.rank import DecodeRank, build_rank, build_runner, create_receiver
from services.decode.tp_mirror import StepFollower, StepMirror, WarmupDone, exchange_addresses
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model_runner import ModelRunner
from services.engine.parallel import TensorParallel
from services.transfer import BaseKVReceiver
from services.transfer.base import pool_layout


class TpFollower:
    """TP rank 1 .. T-1 of a tensor-parallel decode rank: its shard of the model, its pool of
    its KV heads (registered with its own receiver: prefill writes those heads there) and the
    forwards TP rank 0 sends it."""

    def __init__(self, init: RankInit, ctx: RankContext) -> None:
        model = _load(init, ctx)
        self.runner = build_runner(init, model, ctx.device)
        self.receiver = create_receiver(init)
        self.receiver.register(self.runner.kv_pool)
        self.steps = StepFollower(self.runner.device, ctx.device_group)
        _join_tp_rank(init, ctx, self.runner, self.receiver, self.steps)

    def warmup(self) -> None:
        """Follow TP rank 0's warm-up to its end."""
        while not isinstance(inputs := self.steps.receive(WARMUP_POLL_S), WarmupDone):
            if inputs is not None:
                self.runner.forward_decode(inputs)

    def follow(self, timeout_s: float) -> None:
        inputs = self.steps.receive(timeout_s)
        if isinstance(inputs, WarmupDone):
            raise RuntimeError("TP rank 0 warmed up twice")
        if inputs is not None:
            self.runner.forward_decode(inputs)  # the logits are rank 0's to sample

    def close(self) -> None:
        self.steps.close()
        self.receiver.close()


WARMUP_POLL_S = 1.0


def load_shard(init: RankInit, ctx: RankContext, tp: TensorParallel) -> Qwen2_5_VLModel:
    """This rank's share of the language model split as ``tp`` says, once every process of
    the group agreed on the model and the layout (``tp.size`` processes)."""
    agree_on_manifest(
        ctx,
        model_manifest(
            init.model,
            dtype=init.dtype,
            quantization=init.quantization,
            kv_cache_dtype=init.kv_cache_dtype,
            tp_size=tp.size,
            ep_size=init.ep_size,
            page_size=init.page_size,
            max_running_requests=init.max_running_requests,
        ),
    )
    return load_model(
        init.model,
        device=ctx.device,
        dtype=init.dtype,
        components=("language",),
        quantization=init.quantization,
        tp=tp,
    )


def _load(init: RankInit, ctx: RankContext) -> Qwen2_5_VLModel:
    """This TP rank's shard."""
    return load_shard(
        init, ctx, TensorParallel(ctx.rank, init.tp_size, ctx.device_group, init.ep_size)
    )


def _join_tp_rank(
    init: RankInit,
    ctx: RankContext,
    runner: ModelRunner,
    receiver: BaseKVReceiver,
    follower: StepFollower | None,
) -> tuple[list[str], tuple[tuple[str, KvPoolLayout], ...]]:
    """Every rank's pool (session id, layout) and every follower's step address, rank order;
    ``ValueError`` when the ranks sized different pools."""
    mine = (receiver.session_id, pool_layout(runner.kv_pool))
    pools: list[tuple[str, KvPoolLayout]] = [mine] * ctx.world_size
    dist.all_gather_object(pools, mine, group=ctx.cpu_group)
    sizes = {layout.num_pages for _, layout in pools}
    if len(sizes) > 1:
        raise ValueError(
            f"the {init.tp_size} TP ranks sized KV pools of {sorted(sizes)} pages from their "
            "GPUs' memory: give decode --num-pages"
        )
    addresses = exchange_addresses(follower, ctx.rank, ctx.world_size, ctx.cpu_group)
    return addresses, tuple(pools[1:])


def build_tp_rank(init: RankInit, ctx: RankContext) -> DecodeRank:
    """TP rank 0 of a tensor-parallel decode rank: the ``DecodeRank``, mirroring its forwards."""
    model = _load(init, ctx)
    runner = build_runner(init, model, ctx.device)
    receiver = create_receiver(init)
    try:
        receiver.register(runner.kv_pool)
        addresses, peers = _join_tp_rank(init, ctx, runner, receiver, None)
        mirror = StepMirror(addresses, runner.device, ctx.device_group)
    except BaseException:
        receiver.close()
        raise
    rank = build_rank(init, ctx.device, model, receiver, runner=runner, mirror=mirror)
    rank.tp_peers = peers
    return rank
