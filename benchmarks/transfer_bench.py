"""KV transfer between two GPUs of one host: raw NCCL send/recv (the link's ceiling), then the
CUDA IPC KV backend.

One process per GPU. Rank 0 is prefill (sender), rank 1 decode (receiver). Pools have
the 7B layout (28 layers, 4 KV heads, head dim 128, bf16, 16-token pages); a request's
source pages are contiguous, its destination pages shuffled. Each sample starts at a
gloo barrier; it ends when the pages hold the KV: when rank 0's ``send`` returns after its
copy kernel finished (CUDA IPC is one-sided). The median of several samples is reported, and
each case's last transfer is checked page by page on rank 1.

Two kinds of case: one request after the barrier (its latency, with the link idle since
the previous sample), and ``STREAM`` requests started back to back, then awaited (what the
prefill worker does with a batch: ``BaseKVSender.start`` for each, then ``wait``), timed
until the last one landed. Raw NCCL is timed the same way for 1 GiB (the ceiling every
ratio uses) and for one 64 MiB message (what a lone request costs NCCL itself).

Last, what a 64 MiB request's KV adds to its prefill: a stand-in 28-layer forward (per
layer a GEMM for attention, then the layer's KV counts as stored, then one for the MLP:
0.55 TFLOP) is timed alone, then with the KV sent by
CUDA IPC after it (``send``: the link idled through the forward) and layer by layer
during it (``start_layerwise``, what the prefill worker does with cuda_ipc), the three modes
interleaved sample by sample; the rows give each one's time beyond the forward alone and
from the end of its own forward (host sync) until the KV landed.
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
RAW_SMALL_BYTES = 64 << 20
SAMPLES = 7
BACKENDS = ("cuda_ipc",)
# Requests per back-to-back case, started and awaited from one thread (start()/wait()): a thread
# per request is slower, the threads' completion polls contend for the GIL.
STREAM = 8
STREAM_SIZES_MIB = (16, 64, 256)
JOIN_TIMEOUT_S = 150
OVERLAP_MIB = 64  # the request of the prefill-plus-transfer case
# KV: not sent; sent after the forward; layer by layer
OVERLAP_MODES = ("forward only", "after", "layerwise")


def _pool(device: torch.device, num_pages: int) -> Any:
    from services.engine.kv_cache import KVPool

    pool = KVPool(NUM_LAYERS, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    return pool


def _bytes_per_page() -> int:
    return 2 * NUM_LAYERS * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 2


def _raw_ms(rank: int, ctrl: Any, device: torch.device, num_bytes: int) -> float:
    buf = torch.empty(num_bytes, dtype=torch.uint8, device=device)
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


# [2, n]: per page, K and V summed over layers
def _page_sums(pool: Any, pages: list[int]) -> torch.Tensor:
    index = torch.tensor(pages, device=pool.device)
    return torch.stack(
        [buf[:, index].float().sum(dim=(0, 2, 3, 4)) for buf in (pool.k_buffer, pool.v_buffer)]
    ).cpu()


def _cases() -> list[tuple[int, int]]:
    """(MiB per request, requests): one request per size, then ``STREAM`` back to back."""
    return [(mib, 1) for mib in SIZES_MIB] + [(mib, STREAM) for mib in STREAM_SIZES_MIB]


def _num_pages(mib: int) -> int:
    return max(1, round(mib * (1 << 20) / _bytes_per_page()))


def _receiver_samples(
    ctrl: Any, device: torch.device, num_pages: int, backend: str
) -> list[tuple[int, int, int, float]]:
    """Rank 1: the sender's time from the barrier to its last request landing (``send`` or the
    last ``wait`` returned: the kernels finished). Each case's last sample is checked page by
    page."""
    from services.transfer import create_kv_receiver

    pool = _pool(device, num_pages)
    receiver = create_kv_receiver(backend)
    receiver.register(pool)
    out = []
    for mib, k in _cases():
        n = _num_pages(mib)
        times = []
        for sample in range(SAMPLES + 1):
            pages = torch.randperm(num_pages)[: k * n].view(k, n).tolist()
            destinations = [
                receiver.destination(f"{mib}-{k}-{sample}-{i}", pages[i]) for i in range(k)
            ]
            dist.broadcast_object_list(
                [[msgspec.msgpack.encode(d) for d in destinations]], src=1, group=ctrl
            )
            dist.barrier(group=ctrl)
            box: list[Any] = [None]
            # the sender's time, once the bytes landed
            dist.broadcast_object_list(box, src=0, group=ctrl)
            elapsed_ms = box[0]
            if sample:
                times.append(elapsed_ms)
            if sample == SAMPLES:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=ctrl)
                got = _page_sums(pool, pages[-1])
                assert torch.allclose(got, box[0], rtol=1e-3, atol=1e-2), (
                    f"{backend} {k} x {mib} MiB: wrong bytes"
                )
        out.append((mib, k, k * n * _bytes_per_page(), statistics.median(times)))
    receiver.close()
    return out


def _sender_samples(ctrl: Any, device: torch.device, num_pages: int, backend: str) -> None:
    from services.common.destinations import KvDestination
    from services.transfer import create_kv_sender

    pool = _pool(device, num_pages)
    sender = create_kv_sender(backend)
    for mib, k in _cases():
        n = _num_pages(mib)
        src_pages = [list(range(i * n, (i + 1) * n)) for i in range(k)]
        for sample in range(SAMPLES + 1):
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=1, group=ctrl)
            dests = [msgspec.msgpack.decode(raw, type=KvDestination) for raw in box[0]]
            dist.barrier(group=ctrl)
            start = time.perf_counter()
            if k == 1:
                sender.send(
                    dests[0].request_id, pool, src_pages[0], dests[0], time.monotonic() + 60
                )
            else:  # as the prefill worker does with a batch: start every write, then wait for each
                pending = [
                    sender.start(d.request_id, pool, src_pages[i], d, time.monotonic() + 60)
                    for i, d in enumerate(dests)
                ]
                for send in pending:
                    send.wait()
            dist.broadcast_object_list([(time.perf_counter() - start) * 1e3], src=0, group=ctrl)
            if sample == SAMPLES:
                dist.broadcast_object_list([_page_sums(pool, src_pages[-1])], src=0, group=ctrl)
    sender.close()


def _stand_in_layer(device: torch.device) -> tuple[Any, Any]:
    """One prefill layer of the 7B for a 1170-token (64 MiB of KV) prompt, as its two GEMM parts:
    q/k/v + o (8192 output columns, ~0.07 TFLOP), after which the layer's KV is stored, then the
    MLP (gate/up + down, 56832 columns, ~0.48 TFLOP)."""
    x = torch.randn(_num_pages(OVERLAP_MIB) * PAGE_SIZE, 3584, device=device, dtype=torch.bfloat16)
    w_attn = torch.randn(3584, 8192, device=device, dtype=torch.bfloat16)
    w_mlp = torch.randn(3584, 56832, device=device, dtype=torch.bfloat16)
    return (lambda: torch.mm(x, w_attn)), (lambda: torch.mm(x, w_mlp))


def _overlap_sender(ctrl: Any, device: torch.device, num_pages: int) -> None:
    """Rank 0: a 28-layer stand-in forward alone, then with the request's KV sent after it, then
    layer by layer."""
    from services.common.destinations import KvDestination
    from services.transfer import create_kv_sender

    pool, (attention, mlp) = _pool(device, num_pages), _stand_in_layer(device)
    sender, src_pages = create_kv_sender("cuda_ipc"), list(range(_num_pages(OVERLAP_MIB)))
    for sample in range(SAMPLES + 1):
        # interleaved: a clock drift under the GEMM load hits every mode alike
        for mode in OVERLAP_MODES:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=1, group=ctrl)
            dst = msgspec.msgpack.decode(box[0], type=KvDestination)
            dist.barrier(group=ctrl)
            start = time.perf_counter()
            streamed = (
                sender.start_layerwise(dst.request_id, pool, src_pages, dst, time.monotonic() + 60)
                if mode == "layerwise"
                else None
            )
            # as the model's forward: each layer's KV is ready before its MLP
            for i in range(NUM_LAYERS):
                attention()
                if streamed is not None:
                    streamed.layer_done(i)
                mlp()
            # the forward ends (prefill reads its first tokens)
            torch.cuda.current_stream(device).synchronize()
            forward_ms = (time.perf_counter() - start) * 1e3
            if mode == "after":
                sender.send(dst.request_id, pool, src_pages, dst, time.monotonic() + 60)
            elif streamed is not None:
                streamed.finish().wait()
            dist.broadcast_object_list(
                [((time.perf_counter() - start) * 1e3, forward_ms)], src=0, group=ctrl
            )
            if sample == SAMPLES:
                dist.broadcast_object_list([_page_sums(pool, src_pages)], src=0, group=ctrl)
    sender.close()


def _overlap_receiver(
    ctrl: Any, device: torch.device, num_pages: int
) -> dict[str, tuple[float, float]]:
    """Rank 1: {mode: (median ms until the KV landed, median ms from the forward's end)}; the last
    samples are checked."""
    from services.transfer import create_kv_receiver

    pool, n = _pool(device, num_pages), _num_pages(OVERLAP_MIB)
    receiver = create_kv_receiver("cuda_ipc")
    receiver.register(pool)
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in OVERLAP_MODES}
    for sample in range(SAMPLES + 1):
        for mode in OVERLAP_MODES:
            pages = torch.randperm(num_pages)[:n].tolist()
            destination = receiver.destination(f"overlap-{mode}-{sample}", pages)
            dist.broadcast_object_list([msgspec.msgpack.encode(destination)], src=1, group=ctrl)
            dist.barrier(group=ctrl)
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=ctrl)
            if sample:
                samples[mode].append(box[0])
            if sample == SAMPLES:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=ctrl)
                if mode != "forward only":
                    assert torch.allclose(_page_sums(pool, pages), box[0], rtol=1e-3, atol=1e-2), (
                        f"{mode}: wrong bytes"
                    )
    receiver.close()
    return {
        mode: (statistics.median(t for t, _ in got), statistics.median(t - f for t, f in got))
        for mode, got in samples.items()
    }


def _worker(rank: int, port: int, queue: Any) -> None:
    # a hang prints every thread's stack
    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S - 10, exit=True)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(hours=1))
    ctrl = dist.new_group(backend="gloo")
    try:
        raw_ms = _raw_ms(rank, ctrl, device, RAW_BYTES)
        raw_small_ms = _raw_ms(rank, ctrl, device, RAW_SMALL_BYTES)
        num_pages = max(k * _num_pages(mib) for mib, k in _cases()) + 64
        sizes = {}
        for backend in BACKENDS:
            if rank == 0:
                _sender_samples(ctrl, device, num_pages, backend)
            else:
                sizes[backend] = _receiver_samples(ctrl, device, num_pages, backend)
        overlap = (
            _overlap_sender(ctrl, device, num_pages)
            if rank == 0
            else _overlap_receiver(ctrl, device, num_pages)
        )
        if rank == 1:
            queue.put(
                {"raw_ms": raw_ms, "raw_small_ms": raw_small_ms, "sizes": sizes, "overlap": overlap}
            )
        dist.barrier(group=ctrl)
    finally:
        dist.destroy_process_group()


def run_transfer_benchmark() -> list[Row]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(
        _worker, args=(port, queue), nprocs=2, join=False, start_method="spawn"
    )
    deadline_mono = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline_mono:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the 2-GPU transfer benchmark did not finish in {JOIN_TIMEOUT_S} s")
    result = queue.get()
    raw_ms = result["raw_ms"]
    raw_bw = RAW_BYTES / (raw_ms / 1e3)
    small_ms = result["raw_small_ms"]
    rows = [
        Row(
            "transfer",
            "raw NCCL send/recv 1 GiB (ceiling)",
            raw_ms,
            raw_ms,
            note=f"{raw_bw / 1e9:.0f} GB/s",
        ),
        Row(
            "transfer",
            "raw NCCL send/recv 64 MiB, one message",
            small_ms,
            RAW_SMALL_BYTES / raw_bw * 1e3,
            note=f"{RAW_SMALL_BYTES / (small_ms / 1e3) / 1e9:.0f} GB/s",
        ),
    ]
    for backend, sizes in result["sizes"].items():
        for mib, k, num_bytes, ms in sizes:
            rows.append(
                Row(
                    "transfer",
                    f"KV {mib} MiB, {backend}"
                    if k == 1
                    else f"KV {k} x {mib} MiB back to back, {backend}",
                    ms,
                    num_bytes / raw_bw * 1e3,
                    note=f"{num_bytes / (ms / 1e3) / 1e9:.0f} GB/s; "
                    f"{num_bytes // _bytes_per_page()} pages, shuffled",
                )
            )
    forward_ms = result["overlap"]["forward only"][0]
    for mode in OVERLAP_MODES[1:]:
        total_ms, tail_ms = result["overlap"][mode]
        rows.append(
            Row(
                "transfer",
                f"KV {OVERLAP_MIB} MiB behind a 28-layer prefill forward, cuda_ipc, {mode}",
                total_ms - forward_ms,
                None,
                note=f"time the KV adds to the forward ({forward_ms:.2f} ms alone, "
                f"{total_ms:.2f} ms with it); "
                f"{tail_ms:.3f} ms from the forward's end until the KV landed",
            )
        )
    return rows
