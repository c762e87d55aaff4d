"""Tensor-parallel pools hold some of the model's KV heads (``KVPool.head_start`` on): the shm
and inprocess senders copy the heads both pools hold (a prefill rank's heads into decode's
pool of every head, or every head into a decode TP rank's pool) and leave the others alone; the
backends that move whole pages refuse such a write."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine.kv_cache import KVPool
from services.transfer.base import KvDestination, check_compatible, plan_transfer, pool_layout
from services.transfer.inprocess_backend import (
    InProcessFabric,
    InProcessKVReceiver,
    InProcessKVSender,
)
from services.transfer.shm_backend import ShmKVReceiver, ShmKVSender

LAYERS, PAGES, PAGE_SIZE, HEADS, DIM = 2, 6, 4, 4, 8


def pool(num_heads: int = HEADS, head_start: int = 0, fill: float | None = None) -> KVPool:
    kv = KVPool(LAYERS, PAGES, PAGE_SIZE, num_heads, DIM, torch.float32, "cpu", head_start)
    if fill is not None:
        kv.k_buffer.copy_(torch.arange(kv.k_buffer.numel()).view_as(kv.k_buffer) + fill)
        kv.v_buffer.copy_(-kv.k_buffer)
    return kv


def destination(dst_pool: KVPool) -> KvDestination:
    return KvDestination("shm", "s", "r", pool_layout(dst_pool), (1, 2))


def test_check_compatible_gives_the_heads_both_pools_hold() -> None:
    every = destination(pool())
    assert check_compatible(pool_layout(pool()), [0, 1], every) is None  # same heads: pages
    assert check_compatible(pool_layout(pool(2, 2)), [0, 1], every) == (slice(0, 2), slice(2, 4))
    assert check_compatible(pool_layout(pool(1, 1)), [0, 1], every) == (slice(0, 1), slice(1, 2))
    # every head into a decode TP rank's pool of heads 2..3, or heads 1..2 into it
    rank = destination(pool(2, 2))
    assert check_compatible(pool_layout(pool()), [0, 1], rank) == (slice(2, 4), slice(0, 2))
    assert check_compatible(pool_layout(pool(2, 1)), [0, 1], rank) == (slice(1, 2), slice(0, 1))
    assert check_compatible(pool_layout(pool(2, 2)), [0, 1], rank) is None
    with pytest.raises(InvalidRequestError, match=r"KV heads 0\.\.1 here, 2\.\.3 at the dest"):
        check_compatible(pool_layout(pool(2, 0)), [0, 1], rank)


@pytest.mark.parametrize("backend", ["shm", "inprocess"])
def test_each_rank_writes_its_heads_and_only_them(backend: str) -> None:
    dst_pool = pool(fill=0.5)
    before_k, before_v = dst_pool.k_buffer.clone(), dst_pool.v_buffer.clone()
    if backend == "shm":
        receiver, sender = ShmKVReceiver(), ShmKVSender()
    else:
        fabric = InProcessFabric()
        receiver, sender = InProcessKVReceiver(fabric), InProcessKVSender(fabric)
    receiver.register(dst_pool)
    try:
        src_pages, dst_pages = [4, 0, 1], [2, 3, 5]
        ranks = [pool(2, 0, fill=1000.0), pool(2, 2, fill=5000.0)]
        # the second rank only: heads 0 and 1 keep what they held
        dst = receiver.destination("r", dst_pages)
        sender.send("r", ranks[1], src_pages, dst, float("inf"))
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert torch.equal(dst_pool.k_buffer[:, d, :, 2:], ranks[1].k_buffer[:, s])
            assert torch.equal(dst_pool.v_buffer[:, d, :, 2:], ranks[1].v_buffer[:, s])
            assert torch.equal(dst_pool.k_buffer[:, d, :, :2], before_k[:, d, :, :2])
        sender.send("r", ranks[0], src_pages, dst, float("inf"))
        for s, d in zip(src_pages, dst_pages, strict=True):
            whole_k = torch.cat([r.k_buffer[:, s] for r in ranks], dim=2)
            whole_v = torch.cat([r.v_buffer[:, s] for r in ranks], dim=2)
            assert torch.equal(dst_pool.k_buffer[:, d], whole_k)
            assert torch.equal(dst_pool.v_buffer[:, d], whole_v)
        untouched = [p for p in range(PAGES) if p not in dst_pages]
        assert torch.equal(dst_pool.k_buffer[:, untouched], before_k[:, untouched])
        assert torch.equal(dst_pool.v_buffer[:, untouched], before_v[:, untouched])
    finally:
        sender.close()
        receiver.close()


def test_mooncake_descriptors_refuse_some_of_each_pages_heads() -> None:
    dst = KvDestination("mooncake", "h:1", "r", pool_layout(pool()), (1, 2))
    with pytest.raises(InvalidRequestError, match="the mooncake KV backend moves whole pages"):
        plan_transfer(pool_layout(pool(2)), [0, 1], dst)


@pytest.mark.parametrize("backend", ["shm", "inprocess"])
def test_every_head_into_each_decode_tp_ranks_pool(backend: str) -> None:
    """A prefill rank of every head writes each decode TP rank's heads into its pool."""
    src = pool(fill=7.0)
    ranks = [pool(2, 0, fill=0.25), pool(2, 2, fill=0.75)]
    sender = ShmKVSender() if backend == "shm" else None
    fabric = InProcessFabric()
    receivers = []
    try:
        for rank in ranks:
            receiver = ShmKVReceiver() if backend == "shm" else InProcessKVReceiver(fabric)
            receiver.register(rank)
            receivers.append(receiver)
        sender = sender or InProcessKVSender(fabric)
        for receiver in receivers:
            sender.send("r", src, [3, 4], receiver.destination("r", [0, 5]), float("inf"))
        for rank, start in zip(ranks, (0, 2), strict=True):
            heads = slice(start, start + 2)
            assert torch.equal(rank.k_buffer[:, [0, 5]], src.k_buffer[:, [3, 4], :, heads])
            assert torch.equal(rank.v_buffer[:, [0, 5]], src.v_buffer[:, [3, 4], :, heads])
    finally:
        if sender is not None:
            sender.close()
        for receiver in receivers:
            receiver.close()
