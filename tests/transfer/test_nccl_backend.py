"""The NCCL KV backend between two ranks: gloo on CPU (CI), NCCL between two GPUs (gpu marker).

Rank 1 is decode (receiver, zeroed pool), rank 0 is prefill (sender, seeded pool). Checks:
the right bytes land in the right (shuffled) pages and no other page changes; a session
aborted before its KV arrives gets no write and the channel stays aligned for the next
request; the sender refuses a passed deadline and a destination that is not its peer.
"""

from __future__ import annotations

import faulthandler
import os
import time

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.system_load import free_port
from services.common.errors import DeadlineExceededError, UnavailableError
from services.engine.kv_cache import KVPool
from services.transfer.base import KvDestination
from services.transfer.sessions import TransferState

NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 4, 2, 8
SRC_PAGES = {"a": [0, 1, 2, 7], "b": [3, 4], "c": [5, 6, 8]}
DST_PAGES = {"a": [9, 2, 5, 11], "b": [0, 1], "c": [7, 3, 10]}


def _pool(device: torch.device, num_pages: int, seed: int | None) -> KVPool:
    pool = KVPool(NUM_LAYERS, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, device)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=generator))
        pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=generator))
    return pool


def _exchange(dest: KvDestination | None, ctrl: object) -> KvDestination:
    box = [msgspec.msgpack.encode(dest) if dest is not None else None]
    dist.broadcast_object_list(box, src=1, group=ctrl)
    return msgspec.msgpack.decode(box[0], type=KvDestination)


def _receiver(device: torch.device, ctrl: object) -> None:
    from services.transfer.nccl_backend import NcclKVReceiver

    pool = _pool(device, 12, seed=None)
    receiver = NcclKVReceiver(peer_rank=0)
    receiver.register(pool)
    released: list[str] = []

    def release(request_id: str, pages: tuple[int, ...]) -> None:
        released.append(request_id)

    sessions = {}
    for name in ("a", "b", "c"):
        sessions[name] = receiver.open_session(
            name, DST_PAGES[name], time.monotonic() + 60, release
        )
        if name == "b":
            sessions[name].abort()  # decode gave up before prefill sent: the KV must be dropped
        _exchange(sessions[name].destination, ctrl)
    for name in ("a", "c"):
        assert sessions[name].wait(time.monotonic() + 60) is TransferState.SUCCESS, name
    assert sessions["b"].state is TransferState.FAILED and released == ["b"]
    src = _pool(torch.device("cpu"), 10, seed=7)
    dst_k, dst_v = pool.k_buffer.cpu(), pool.v_buffer.cpu()
    written = set()
    for name in ("a", "c"):
        for s, d in zip(SRC_PAGES[name], DST_PAGES[name], strict=True):
            assert torch.equal(dst_k[:, d], src.k_buffer[:, s]) and torch.equal(
                dst_v[:, d], src.v_buffer[:, s]
            )
            written.add(d)
    untouched = [p for p in range(12) if p not in written]
    assert not dst_k[:, untouched].any() and not dst_v[:, untouched].any(), (
        "a page outside the sessions changed"
    )
    dist.barrier(group=ctrl)
    receiver.close()


def _sender(device: torch.device, ctrl: object) -> None:
    from services.transfer.nccl_backend import NcclKVSender

    pool = _pool(device, 10, seed=7)
    sender = NcclKVSender(peer_rank=1, num_chunks=2)
    for name in ("a", "b", "c"):
        dest = _exchange(None, ctrl)
        result = sender.send(name, pool, SRC_PAGES[name], dest, time.monotonic() + 60)
        assert result.num_bytes == 2 * NUM_LAYERS * len(SRC_PAGES[name]) * pool.page_nbytes
        assert result.num_descriptors == 1 + 2  # header + 2 chunks, whatever the page count
    with pytest.raises(DeadlineExceededError):
        sender.send(
            "late", pool, [0], msgspec.structs.replace(dest, page_ids=(0,)), time.monotonic() - 1
        )
    stranger = msgspec.structs.replace(dest, session_id="nccl:5", page_ids=(0,))
    with pytest.raises(UnavailableError):
        sender.send("stranger", pool, [0], stranger, time.monotonic() + 10)
    dist.barrier(group=ctrl)


def _worker(rank: int, port: int, backend: str) -> None:
    faulthandler.dump_traceback_later(100, exit=True)  # a hang prints every thread's stack
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    ctrl = dist.new_group(backend="gloo")
    try:
        (_sender if rank == 0 else _receiver)(device, ctrl)
    finally:
        dist.destroy_process_group()


def run_two_ranks(backend: str, timeout_s: float = 120.0) -> None:
    context = mp.start_processes(
        _worker, args=(free_port(), backend), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"two-rank {backend} transfer did not finish in {timeout_s} s")


@pytest.mark.slow
def test_transfer_over_gloo_on_cpu() -> None:
    run_two_ranks("gloo")


@pytest.mark.gpu
def test_transfer_over_nccl_between_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_two_ranks("nccl")
