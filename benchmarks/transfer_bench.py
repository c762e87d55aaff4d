"""KV transfer between two GPUs of one host: raw NCCL send/recv, then the NCCL KV backend.

One process per GPU. Rank 0 is prefill (sender), rank 1 decode (receiver, listener
thread). Pools have the 7B layout (28 layers, 4 KV heads, head dim 128, bf16, 16-token
pages); a request's source pages are contiguous, its destination pages shuffled. Each
sample starts at a gloo barrier and ends when rank 1's session is SUCCESS (pages
written), timed on rank 1; the median of several samples is reported.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import statistics
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.report import Row

SIZES_MIB = (16, 64, 256, 1024)
NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 28, 16, 4, 128
RAW_BYTES = 1 << 30
SAMPLES = 7
JOIN_TIMEOUT_S = 120


def _pool(device: torch.device, num_pages: int) -> Any:
    from services.engine.kv_cache import KVPool

    pool = KVPool(NUM_LAYERS, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    return pool


def _bytes_per_page() -> int:
    return 2 * NUM_LAYERS * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 2


def _raw_ms(rank: int, ctrl: Any, device: torch.device) -> float:
    buf = torch.empty(RAW_BYTES, dtype=torch.uint8, device=device)
    times = []
    for sample in range(SAMPLES + 1):  # the first sample also sets up the NCCL communicator
        dist.barrier(group=ctrl)
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        torch.cuda.synchronize(device)
        if sample:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _receiver_samples(ctrl: Any, device: torch.device, num_pages: int) -> list[tuple[int, int, float]]:
    from services.transfer.nccl_backend import NcclKVReceiver

    pool = _pool(device, num_pages)
    receiver = NcclKVReceiver(peer_rank=0)
    receiver.register(pool)
    out = []
    for mib in SIZES_MIB:
        n = max(1, round(mib * (1 << 20) / _bytes_per_page()))
        times = []
        for sample in range(SAMPLES + 1):
            pages = torch.randperm(num_pages)[:n].tolist()
            session = receiver.open_session(f"{mib}-{sample}", pages, time.monotonic() + 60, lambda r, p: None)
            dist.broadcast_object_list([msgspec.msgpack.encode(session.destination)], src=1, group=ctrl)
            dist.barrier(group=ctrl)
            start = time.perf_counter()
            state = session.wait(time.monotonic() + 60)
            assert state.name == "SUCCESS", f"transfer of {mib} MiB ended {state}"
            if sample:
                times.append((time.perf_counter() - start) * 1e3)
        out.append((mib, n * _bytes_per_page(), statistics.median(times)))
    receiver.close()
    return out


def _sender_samples(ctrl: Any, device: torch.device, num_pages: int) -> None:
    from services.transfer.base import KvDestination
    from services.transfer.nccl_backend import NcclKVSender

    pool = _pool(device, num_pages)
    sender = NcclKVSender(peer_rank=1)
    for mib in SIZES_MIB:
        n = max(1, round(mib * (1 << 20) / _bytes_per_page()))
        for sample in range(SAMPLES + 1):
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=1, group=ctrl)
            dest = msgspec.msgpack.decode(box[0], type=KvDestination)
            dist.barrier(group=ctrl)
            sender.send(f"{mib}-{sample}", pool, list(range(n)), dest, time.monotonic() + 60)


def _worker(rank: int, port: int, queue: Any) -> None:
    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S - 10, exit=True)  # a hang prints every thread's stack
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(hours=1))
    ctrl = dist.new_group(backend="gloo")
    try:
        raw_ms = _raw_ms(rank, ctrl, device)
        num_pages = -(-max(SIZES_MIB) * (1 << 20) // _bytes_per_page()) + 64
        if rank == 0:
            _sender_samples(ctrl, device, num_pages)
        else:
            queue.put({"raw_ms": raw_ms, "sizes": _receiver_samples(ctrl, device, num_pages)})
        dist.barrier(group=ctrl)
    finally:
        dist.destroy_process_group()


def run_transfer_benchmark() -> list[Row]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_worker, args=(port, queue), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the 2-GPU transfer benchmark did not finish in {JOIN_TIMEOUT_S} s")
    result = queue.get()
    raw_ms = result["raw_ms"]
    raw_bw = RAW_BYTES / (raw_ms / 1e3)
    rows = [Row("transfer", "raw NCCL send/recv 1 GiB (ceiling)", raw_ms, raw_ms, note=f"{raw_bw / 1e9:.0f} GB/s")]
    for mib, num_bytes, ms in result["sizes"]:
        rows.append(Row(
            "transfer", f"KV {mib} MiB", ms, num_bytes / raw_bw * 1e3,
            note=f"{num_bytes / (ms / 1e3) / 1e9:.0f} GB/s; {num_bytes // _bytes_per_page()} pages, shuffled",
        ))
    return rows
